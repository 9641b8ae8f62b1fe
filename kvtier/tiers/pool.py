"""PoolTier: the client side of kvtier-pool, a tier of a TieredStore (remote DRAM, or this host's node pool).

Runs in the engine process. Where blocks go and where they are found is the route's business
(kvtier/tiers/pool_route.py: a static list of pools, or kvtier-master); moving them is the transport's
(kvtier/transport: raw TCP data sockets, zmq frames, RDMA, or the pool's shared-memory file for a pool on
this host).

Never a hang, never wrong bytes: every pool call has a timeout (``timeout_s``, default 0.5 s, measured as time
without progress); a pool that misses it, refuses, or speaks another protocol version turns that call's
keys into misses (get), False (put, contains) and is skipped for a back-off (0.5 s doubling to 10 s; a
version mismatch: 60 s, logged as an error) instead of being waited on again. The engine then recomputes.
Calls to several pools run in parallel.

Write-behind: ``put_later`` (what the store's offloader calls on a DRAM eviction or a write-through) stages
blocks and sends them from a background thread (kvtier/tiers/writebehind.py, the same WriteBehind the SSD
tier composes; here it owns its staged map and lock); staged blocks are readable until sent. Pins of the store
are not enforced in remote pools (they evict by their own policy); the pool's evictions are not reported back to
the store (the master hears them from the pool).

Thread-safe; buffers as in the Tier protocol (copied before put returns, ``out`` written before get returns).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvtier.auth import AuthError, ClientKeys, load_keypair
from kvtier.backoff import Backoff, Clock
from kvtier.blocks import block_rows
from kvtier.iothreads import IoThreads
from kvtier.pins import PinTable
from kvtier.policies import Observations
from kvtier.ratelog import RateLimitedLog
from kvtier.settings.pool import PoolKeys
from kvtier.tiers.base import EvictListener, RemoteTier, TierStats, WriteBehindStaging
from kvtier.tiers.pool_recent import RecentlyHeld
from kvtier.tiers.pool_route import MasterRoute, PeerRoute, PoolRoute
from kvtier.tiers.writebehind import WriteBehind, staging_of
from kvtier.transport import connect
from kvtier.transport.base import PoolConnection, PoolError, PoolProtocolError, PoolUnavailable
from kvtier.wire import observations as observations_wire

log = logging.getLogger(__name__)

T = TypeVar("T")
BACKOFF_S = (0.5, 10.0)  # first and longest back-off after a pool fails
PROTOCOL_BACKOFF_S = 60.0
MAX_SEND_BYTES = 256 << 20  # one write-behind send: at most this much
MAX_OBSERVING = 4  # observation batches in flight to the pools at once; more are dropped (counted)


class _PoolEndpoint:
    """One pool endpoint as PoolTier sees it: its connection (made on first use), the pool's incarnation, and
    its health (a Backoff). ``lock`` serialises making the connection; one per endpoint, in ``PoolTier._pools``."""

    def __init__(self, endpoint: str, clock: Clock = time.monotonic) -> None:
        self.endpoint = endpoint
        self.conn: PoolConnection | None = None
        self.epoch: int | None = None  # the pool's incarnation when last seen
        self.health = Backoff(*BACKOFF_S, clock=clock)
        self.last_error = ""
        self.lock = threading.Lock()

    def up(self) -> bool:
        return self.health.up()


class PoolTier(WriteBehindStaging, RemoteTier):
    """Blocks in one or more kvtier-pools. ``transport``: auto, stream, tcp, rdma or shm (see
    kvtier.transport.connect); ``copy_threads``: the shm transport's threads per copy (0: by batch
    size)."""

    name = "pool"

    def __init__(self, block_bytes: int, route: PoolRoute, *, transport: str = "auto", timeout_s: float = 0.5,
                 connections: int = 4, staging_bytes: int = 256 << 20, dtypes: Sequence[str] = (),
                 auth_dir: str = "", copy_threads: int = 0, clock: Clock = time.monotonic) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if auth_dir:  # this client's keypair must be there from the start (AuthError); the pools' keys per connect
            load_keypair(Path(auth_dir) / "client.key_secret")
        self.auth_dir = auth_dir
        self.block_bytes = block_bytes
        self.route = route
        self.transport = transport
        self.timeout_s = timeout_s
        self.connections = connections
        self.copy_threads = copy_threads  # shm transport: threads per host copy, 0 = by measured rate
        self._dtypes = tuple(dtypes)
        self._pools: dict[str, _PoolEndpoint] = {}
        self._clock = clock  # the pools' back-offs read it (a test moves it instead of sleeping)
        self._lock = threading.Lock()
        self._fanout = IoThreads(8, "kvtier-pool-fanout", "pool tier")  # a close at exit still reaches every pool
        self._writer = (WriteBehind(self._send_staged, staging_of(block_bytes, staging_bytes), block_bytes=block_bytes,
                                    max_batch=max(1, MAX_SEND_BYTES // block_bytes), name="pool", what="pool")
                        if staging_bytes else None)  # owns its staged map and lock; counts as write_behind
        self._stats = TierStats(self.name, 0, 0, 0)
        self._recent = RecentlyHeld()
        self._bad = RateLimitedLog(log, 10.0)
        self._no_pool_blocks = 0  # blocks a put had no pool for (none registered, listed or up)
        self._no_pool = False  # the last put found no pool at all
        self._closed = False
        self._scope = secrets.token_hex(8)  # what the pools scope this engine's sessions and requests by
        self._observing = 0  # observation batches being sent in the background
        self._observations_dropped = 0

    @classmethod
    def from_config(cls, cfg: PoolKeys, block_bytes: int, dtypes: Sequence[str] = ()) -> PoolTier:
        """The pool tier a Config's PoolKeys describe (its arguments: ``cfg.pool_args``): kvtier-master's
        placements when ``master`` is set, else the pools listed in ``pool``."""
        route: PoolRoute = (MasterRoute(cfg.master, cfg.node_id or default_node_id(), cfg.pool_timeout_ms / 1000,
                                        auth_dir=cfg.auth_dir)
                            if cfg.master else PeerRoute(cfg.pool_endpoints()))
        tier = cls(route=route, **cfg.pool_args(block_bytes, dtypes))
        tier.connect_all()
        return tier

    def connect_all(self) -> None:
        """Say hello to every pool the route knows now, so ``stats()`` has their capacity from the start and a
        misconfigured pool (another block size or protocol version) is logged at once. Best effort: a pool
        that is down is retried when it is used."""
        for endpoint in self.route.endpoints():
            try:
                self._call(endpoint, lambda conn: None)
            except PoolError:
                pass  # logged by _failed; the pool is in its back-off

    # ---- Tier protocol ---------------------------------------------------------------------------------

    def attach(self, pins: PinTable, on_evict: EvictListener | None) -> None:
        pass  # remote pools evict by their own policy; the master hears their evictions from them

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        held = self._writer.is_staged(keys) if self._writer is not None else [False] * len(keys)
        todo = [i for i, h in enumerate(held) if not h]
        if not todo:
            return held
        where = self._locate([keys[i] for i in todo])
        if self.route.authoritative:
            for i, e in zip(todo, where):
                held[i] = e is not None and self._pool(e).up()
            return held
        found = self._per_pool([keys[i] for i in todo], where, lambda conn, ks, _idx: conn.contains(ks), "contains")
        for i, h in zip(todo, found):
            held[i] = bool(h)
        return held

    def held_locally(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys this process knows a pool holds without asking one (staged for sending, or recently
        stored or fetched): what the store's offloader checks before sending an evicted block again."""
        staged = self._writer.is_staged(keys) if self._writer is not None else [False] * len(keys)
        return [a or b for a, b in zip(staged, self._recent.has(keys))]

    def put(self, keys: Sequence[bytes], blocks: Any) -> list[bool]:
        rows = block_rows(blocks, len(keys), self.block_bytes, dtypes=self._dtypes)
        return self._put(list(keys), rows.ptrs)

    def get(self, keys: Sequence[bytes], out: Any) -> list[bool]:
        rows = block_rows(out, len(keys), self.block_bytes, writable=True, dtypes=self._dtypes, what="out")
        hit = self._writer.read(keys, rows.ptrs) if self._writer is not None else [False] * len(keys)
        todo = [i for i, h in enumerate(hit) if not h]
        if todo:
            ptrs = rows.ptrs[todo]
            got = self._per_pool([keys[i] for i in todo], self._locate([keys[i] for i in todo]),
                                 lambda conn, ks, idx: conn.get(ks, ptrs[idx]), "get")
            for i, h in zip(todo, got):
                hit[i] = bool(h)
            self._recent.add([keys[i] for i in todo if hit[i]])
        hits = sum(hit)
        with self._lock:
            s = self._stats
            s.hits += hits
            s.misses += len(keys) - hits
            s.get_bytes += hits * self.block_bytes
        return hit

    def remove(self, keys: Sequence[bytes]) -> int:
        keys = list(keys)
        self._recent.drop(keys)
        if self.route.authoritative:
            targets = {e for e in self._locate(keys) if e is not None}
        else:
            targets = set(self.route.endpoints())  # a key may sit on another pool than its hash names
        total = 0
        for endpoint in sorted(targets):
            try:
                total += self._call(endpoint, lambda conn: conn.remove(keys))
            except PoolError as e:
                self._bad("remove:" + endpoint, logging.WARNING, "pool remove failed: %s", e)
        return total

    # ---- what the engine knows (observations), for the pools' policies ---------------------------------

    @property
    def observes(self) -> bool:
        """Always: a pool evicts by its own policy, which learns the agents when told (a keys-only one ignores
        the op's content)."""
        return True

    def observe(self, batch: Observations) -> None:
        """Send a resolved batch to every pool there is (with kvtier-master: every pool registered, as of at most
        pool_route.REFRESH_S ago, not only those this process has used), cut to the pools' key limit (each engine
        sharing a pool tells it about its own agents; the pool scopes them by ``scope``). With write-behind (staging
        memory) on a background thread, at most MAX_OBSERVING batches at once, the rest dropped and counted (a
        policy missing an observation ranks an agent a little worse; nothing else depends on it); without, on
        the caller's thread (a replay's order)."""
        times = [o.time for o in (*batch.arrivals, *batch.completions, *batch.hints) if o.time is not None]
        now = max(times, default=self._clock())
        if self._writer is None:
            self._send_observations(batch, now)
            return
        with self._lock:
            if self._observing >= MAX_OBSERVING:
                self._observations_dropped += 1
                return
            self._observing += 1
        try:
            self._fanout.submit(self._send_observations, batch, now).add_done_callback(self._observed)
        except RuntimeError:  # closed
            self._observed(None)

    def _observed(self, _future: object) -> None:
        with self._lock:
            self._observing -= 1

    def _send_observations(self, batch: Observations, now: float) -> None:
        for endpoint in self.route.endpoints(fresh=True):  # every pool: each evicts by what its engines tell it
            if not self._up(endpoint):
                continue
            try:
                self._call(endpoint, lambda conn: self._observe_one(conn, batch, now))
            except PoolError as e:
                self._bad("observe:" + endpoint, logging.WARNING, "pool observe failed (its policy misses these "
                          "observations): %s", e)

    def _observe_one(self, conn: PoolConnection, batch: Observations, now: float) -> None:
        for part in observations_wire.split(batch, conn.info.max_keys):
            conn.observe(observations_wire.encode(part, now, self._scope))

    def stats(self) -> TierStats:
        with self._lock:
            pools = list(self._pools.values())
        s = self._stats
        s.capacity_bytes = sum(p.conn.info.capacity for p in pools if p.conn is not None)
        staged = self._writer.counts if self._writer is not None else {}
        s.extra = {"pools": {p.endpoint: {"transport": p.conn.transport if p.conn else None, "up": p.up(),
                                          "last_error": p.last_error} for p in pools},
                   "no_pool": self._no_pool, "no_pool_blocks": self._no_pool_blocks,
                   "observations_dropped": self._observations_dropped,
                   "write_behind": dict(staged), **({"route": route} if (route := self.route.stats()) else {})}
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        self._fanout.close()
        with self._lock:
            pools = list(self._pools.values())
        for p in pools:
            if p.conn is not None:
                p.conn.close()
        self.route.close()

    # ---- write-behind (the store's offloader) ------------------------------------------------------------

    def put_later(self, keys: Sequence[bytes], blocks: Any, *, wait: bool) -> Future[list[bytes]] | None:
        """Stage blocks now and send them in the background; the Future gives the keys the pools now hold."""
        rows = block_rows(blocks, len(keys), self.block_bytes, dtypes=self._dtypes)
        if self._writer is None:
            done: Future[list[bytes]] = Future()
            done.set_result([k for k, h in zip(keys, self._put(list(keys), rows.ptrs)) if h])
            return done
        return self._writer.submit(keys, rows.ptrs, wait=wait)

    def flush(self, timeout: float | None = None) -> bool:
        return True if self._writer is None else self._writer.flush(timeout)

    def _send_staged(self, keys: list[bytes], rows: np.ndarray) -> set[bytes]:
        """Write-behind's batch (writer thread): the keys the pools now hold."""
        return {k for k, h in zip(keys, self._put(keys, rows)) if h}

    # ---- internals -------------------------------------------------------------------------------------

    def _put(self, keys: list[bytes], ptrs: np.ndarray) -> list[bool]:
        try:
            where = self.route.place(keys, self.block_bytes, self._up)
        except PoolError as e:
            self._bad("place", logging.WARNING, "pool put of %d blocks not placed: %s", len(keys), e)
            where = [None] * len(keys)
        self._placed(sum(w is None for w in where), len(keys))
        held = [bool(h) for h in self._per_pool(keys, where, lambda conn, ks, idx: conn.put(ks, ptrs[idx]), "put")]
        self._recent.add([k for k, h in zip(keys, held) if h])
        self._recent.drop([k for k, h in zip(keys, held) if not h])  # failed or refused: not held, send again
        stored = sum(held)
        with self._lock:
            self._stats.puts += stored
            self._stats.put_bytes += stored * self.block_bytes
            self._stats.rejected += len(keys) - stored
        return held

    def _placed(self, unplaced: int, n: int) -> None:
        """Count and say (once per 10 s) when a put had no pool for its blocks: pools that never registered
        with the master, or all down, are otherwise silent misses for ever."""
        with self._lock:
            self._no_pool_blocks += unplaced
            self._no_pool = unplaced == n and n > 0
        if not unplaced:
            return
        known = self.route.endpoints()
        states = "; ".join(f"{e} {'up' if self._up(e) else 'down (' + self._pool(e).last_error + ')'}"
                           for e in known) or "none known"
        hint = ""
        if self.route.authoritative and not known:
            hint = (" -- the master names no kvtier-pool: is each pool started with --master pointing at it, and "
                    "does it log 'reporting to master'?")
        self._bad("no-pool", logging.WARNING, "no pool reachable: %d of %d blocks of a put not stored in a pool "
                  "(%s; pools: %s)%s", unplaced, n, self.route.describe(), states, hint)

    def _locate(self, keys: list[bytes]) -> list[str | None]:
        try:
            return self.route.locate(keys, self._up)
        except PoolError as e:
            self._bad("locate", logging.WARNING, "pool lookup of %d keys failed (misses): %s", len(keys), e)
            return [None] * len(keys)

    def _per_pool(self, keys: list[bytes], where: Sequence[str | None],
                  fn: Callable[[PoolConnection, list[bytes], list[int]], Sequence[Any]], what: str) -> list[Any]:
        """Run ``fn(conn, keys of that pool, their indices)`` per pool, in parallel; None where a pool failed."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, e in enumerate(where):
            if e is not None:
                groups[e].append(i)
        out: list[Any] = [None] * len(keys)

        def one(endpoint: str, index: list[int]) -> None:
            try:
                got = self._call(endpoint, lambda conn: fn(conn, [keys[i] for i in index], index))
            except PoolError as e:
                self._bad(f"{what}:{endpoint}", logging.WARNING, "pool %s of %d blocks failed (%s): %s", what,
                          len(index), "misses" if what != "put" else "not stored", e)
                return
            for i, r in zip(index, got):
                out[i] = r

        items = list(groups.items())
        if len(items) == 1:
            one(*items[0])
        else:
            for f in self._fanout.run_each(one, items):
                f.result()
        return out

    def _call(self, endpoint: str, fn: Callable[[PoolConnection], T]) -> T:
        pool = self._pool(endpoint)
        if not pool.up():
            raise PoolUnavailable(endpoint, f"skipped for {pool.health.left_s():.1f} s more after: "
                                            f"{pool.last_error}", "backoff")
        with pool.lock:
            if pool.conn is None:
                if not pool.up():  # another thread's connect just failed
                    raise PoolUnavailable(endpoint, pool.last_error, "backoff")
                try:
                    pool.conn = connect(endpoint, self.block_bytes, transport=self.transport,
                                        timeout_s=self.timeout_s, lanes=self.connections, auth=self._auth(endpoint),
                                        copy_threads=self.copy_threads)
                except PoolUnavailable as e:
                    self._failed(pool, e)
                    raise
                except PoolError as e:  # refused at hello (another block size, no shm, ...): a setup error
                    self._failed(pool, PoolProtocolError(endpoint, e.message, e.code))
                    raise
        try:
            result = fn(pool.conn)
        except PoolError as e:
            self._failed(pool, e)
            raise
        finally:
            self._check_epoch(pool)
        if pool.health.answered():
            log.info("pool %s is answering again", endpoint)
        return result

    def _auth(self, endpoint: str) -> ClientKeys | None:
        """The CurveZMQ keys for ``endpoint`` (auth_dir's server.key, or servers/<endpoint>.key); a key file
        that went missing is a setup error for this pool (PoolProtocolError: logged, backed off)."""
        if not self.auth_dir:
            return None
        try:
            return ClientKeys.load(self.auth_dir, endpoint)
        except AuthError as e:
            raise PoolProtocolError(endpoint, str(e), "auth") from None

    def _check_epoch(self, pool: _PoolEndpoint) -> None:
        """A pool that restarted (a new epoch) lost its blocks: forget which keys this process saw held, so the
        offloader sends evicted blocks again instead of skipping them (the table does not say which pool held
        a key, so all of it goes: a few blocks sent twice, never a block lost)."""
        conn = pool.conn
        if conn is None:
            return
        epoch = conn.info.epoch
        if pool.epoch is not None and epoch != pool.epoch:
            self._recent.clear()
            log.warning("pool %s restarted: forgetting which blocks pools held (the offloader sends them again)",
                        pool.endpoint)
        pool.epoch = epoch

    def _failed(self, pool: _PoolEndpoint, e: PoolError) -> None:
        if isinstance(e, (PoolProtocolError, PoolUnavailable)):
            self._recent.clear()  # it may come back restarted, empty: nothing it held counts as sent any more
        if isinstance(e, PoolProtocolError):
            pool.health.failed(hold_s=PROTOCOL_BACKOFF_S)
            log.error("pool %s cannot be used: %s; retrying in %.0f s", pool.endpoint, e.message, PROTOCOL_BACKOFF_S)
        elif isinstance(e, PoolUnavailable):
            if pool.health.failed():
                log.warning("pool %s unavailable (%s); its blocks are misses until it answers again",
                            pool.endpoint, e.message)
        pool.last_error = e.message

    def _pool(self, endpoint: str) -> _PoolEndpoint:
        with self._lock:
            pool = self._pools.get(endpoint)
            if pool is None:
                pool = self._pools[endpoint] = _PoolEndpoint(endpoint, self._clock)
            return pool

    def _up(self, endpoint: str) -> bool:
        return self._pool(endpoint).up()


def default_node_id() -> str:
    """This process's name with the master when the config gives none."""
    return f"{socket.gethostname()}-{os.getpid()}"
