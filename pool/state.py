"""PoolState: what one kvtier-pool process owns: its DRAM tier, the one-sided leases, the budgets, counters,
its node agent.

Sizing: a pool holds blocks of one size. ``--block-bytes`` fixes it at start. Without it the pool is sized by
the first request that stores data (a ``put``, a ``reserve`` or a put on the data port), never by a hello:
a hello only says what it expects, so a port scan, a health check or a stranger's hello of the wrong size
cannot decide the layout real engines then get refused by. (Any client admitted, with --insecure-bind anyone
who reaches the port, can still store first: give ``--block-bytes`` where strangers can reach it.) A client whose blocks have
another size is refused, naming both; blocks under MIN_BLOCK_BYTES are refused, and a client-chosen size
gets at most ``max_slots`` slots so bookkeeping stays a small share of the memory. When the pool serves an
ipc:// endpoint (standalone mode: engine processes on this host), its DRAM is a file under ``shm_dir`` that
clients map once (and ``<file>.gen``, the slots' generations, kvtier/wire/generations.py); the file name
carries the pool's epoch, so a restarted pool never reuses a file an old mapping still points into (stale
files of earlier runs of the same endpoint are removed at start).

With ``--master`` the node agent registers at start, sized or not (engines in distributed mode find pools
only through the master, and their first put sizes it). There the pool is a client of the master, and uses the
SDK's public entry for it, ``kvtier.client.NodeAgent``, as any node does (the only client-side import of the
pool besides pool/replicas.py's ``kvtier.transport.connect`` and pool/ops.py's ``pool_offers``, the transports'
table its hello offers from; tests/test_layering.py holds the line).

Thread-safe: the pool's worker threads share it; the tier, the lease table and the budgets lock for
themselves.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth import ClientKeys, DataTokens
from kvtier.memory.hostcopy import copy_rows
from kvtier.keys import KEY_BYTES
from kvtier.pins import PinTable
from kvtier.pool.budget import Budget
from kvtier.pool.clients import Client, Sessions
from kvtier.pool.leases import ClientLeases
from kvtier.pool.rdma import RdmaServer
from kvtier.pool.replicas import Copier
from kvtier.pool.sizing import METADATA_SHARE, MIN_BLOCK_BYTES, block_size_problem, max_slots
from kvtier.store.types import StoreEvent
from kvtier.tiers.dram import DramTier, Reservation
from kvtier.units import format_bytes
from kvtier.wire import WireError
from kvtier.wire.generations import SlotGenerations
from kvtier.wire.observations import SenderClock
from kvtier.wire.pool import ERR_NOT_READY, ERR_WRONG_SIZE, MIN_HELD_BLOCKS, PAGES_LABEL, POOL_LABELS
from kvtier.wire.verbs import unavailable_reason

log = logging.getLogger("kvtier.pool")

TIER = "dram"  # the name the pool's tier is registered under with the master
STAGING_DEFAULT = (256 << 20, 4 << 30)  # --staging-bytes 0: capacity/8, at least 256 MiB, at most 4 GiB
REQUESTS_IN_SHARE = 8  # a client's share of the held budget holds this many of its largest requests


@dataclass
class PoolSettings:
    """The daemon's knobs (``kvtier-pool --help`` documents each)."""

    bind: tuple[str, ...] = ("tcp://127.0.0.1:7400",)
    capacity: int = 8 << 30
    block_bytes: int = 0  # 0: set by the first client's hello
    node_id: str = ""
    master: str = ""
    advertise: str = ""
    workers: int = 2
    shm_dir: str = "/dev/shm"
    lease_s: float = 30.0
    eviction: str = "lru"
    # Where the policy reads time: "local" (this host's monotonic clock; the senders' observation times are moved
    # onto it), or "sender" (the latest time the senders' observations carried: a replay's stand-in pool).
    policy_clock: str = "local"
    max_keys: int = 1 << 16
    max_frame_bytes: int = 64 << 20  # the largest zmq frame taken in (and at least one block: server.py)
    copy_threads: int = 1
    prefault: bool = False
    rdma: str = "auto"
    stream: str = "auto"  # the raw TCP data port: auto (the tcp bind's host, a free port), off, or host:port
    stream_max_connections: int = 256  # data connections at once; more are refused (one thread each)
    stream_message_timeout_s: float = 30.0  # the longest one data message (<= 16 MiB) may take
    stream_pending_max: int = 1024  # data connections not yet admitted (no token / no first byte yet) at once
    staging_bytes: int = 0  # memory beyond the capacity for clients' requests and replies; 0: auto
    client_share: float = 0.25  # of the capacity one client may hold unevictable (leases, replies in flight)
    handshake_s: float = 2.0  # a connection must finish its handshake (token, zmq greeting, CURVE) this fast
    metrics_port: int | None = None  # Prometheus /metrics (pool/metrics.py); None: off, 0: a free port
    metrics_host: str = "127.0.0.1"
    heartbeat_s: float | None = None
    auth_dir: str = ""  # CurveZMQ keys (kvtier/auth): server keypair, authorized/, master.key; "": the owner token
    # Without keys: False admits only this user's processes (the owner token, kvtier/auth/owner.py), True anyone
    # who reaches the ports (--insecure-bind).
    insecure_bind: bool = False
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def ipc(self) -> str | None:
        return next((e for e in self.bind if e.startswith("ipc://")), None)

    @property
    def staging_limit(self) -> int:
        if self.staging_bytes:
            return self.staging_bytes
        return min(STAGING_DEFAULT[1], max(STAGING_DEFAULT[0], self.capacity // 8))


class PoolState:
    """The pool's state; ``serve_*`` ops in pool/ops.py read and change it."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.epoch = secrets.randbits(62)
        # The policy's clock when it reads the senders' times (--policy-clock sender), else None: monotonic.
        self.policy_clock = SenderClock() if settings.policy_clock == "sender" else None
        cap = settings.capacity
        # What clients may allocate beyond the capacity (half of it per client), and what they may hold
        # unevictable (half the capacity, --client-share of it per client): pool/budget.py.
        self.memory = Budget("memory", settings.staging_limit, settings.staging_limit // 2)
        share = max(1, int(cap * settings.client_share))
        self.held = Budget("held", max(cap // 2, share), share)
        self.leases = ClientLeases(settings.lease_s, budget=self.held)
        self.sessions = Sessions()
        self.generations: SlotGenerations | None = None
        # The hook kvtier/auth's roles plug into: a client's CurveZMQ key -> its role ("" for none).
        self.role_of: Any = None
        self.tier: DramTier | None = None
        self.agent: Any = None  # kvtier.client.NodeAgent when --master is given
        self.rdma: RdmaServer | None = None  # when a device is there (pool/rdma.py)
        self.endpoints: list[str] = []  # what the server bound (ports resolved)
        self.stream_port = 0  # the raw TCP data port (pool/stream.py), 0: none
        self.metrics_port = 0  # the Prometheus port (pool/metrics.py), 0: none
        self.dispatcher: Any = None  # kvtier.pool.dispatch.Dispatcher, for the metrics (requests waiting)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        # Unless the pool serves anyone (--insecure-bind without keys), a hello (keys or owner token passed)
        # hands out a token the data port asks for (kvtier/auth/tokens.py).
        self.tokens = DataTokens() if settings.auth_dir or not settings.insecure_bind else None
        self.master_keys = _master_keys(settings)  # read now: a bad master.key is a start-up error
        # Pool-to-pool copies (hot-block replication, the copy_from op): pool/replicas.py.
        self.copier = Copier(self)
        self.shm_path: Path | None = None
        if settings.ipc:
            self.shm_path = _shm_file(Path(settings.shm_dir), settings.ipc, self.epoch)

    def start(self, endpoints: list[str]) -> None:
        """The server is bound to ``endpoints``: create the tier now if its block size is known, and register
        with the master either way."""
        self.endpoints = endpoints
        if self.settings.block_bytes:
            self.ensure_tier(self.settings.block_bytes, by_client=False)
        else:
            log.info("pool %s: no --block-bytes; the first client to store a block sets the block size (give "
                     "--block-bytes where strangers can reach the pool: --insecure-bind)", self.node_id)
        self._start_agent()

    @property
    def node_id(self) -> str:
        return self.settings.node_id or f"pool-{socket.gethostname()}-{_short(self.advertised)}"

    @property
    def advertised(self) -> str:
        """The endpoint peers reach this pool at (what the master hands out)."""
        if self.settings.advertise:
            return self.settings.advertise
        tcp = [e for e in self.endpoints if e.startswith("tcp://")]
        if not tcp:
            return self.endpoints[0] if self.endpoints else ""
        host_port = tcp[0][len("tcp://"):]
        host, _, port = host_port.rpartition(":")
        if host in ("0.0.0.0", "*", "[::]", "::"):
            host = socket.gethostname()
        return f"tcp://{host}:{port}"

    # ---- the tier --------------------------------------------------------------------------------------

    def ensure_tier(self, block_bytes: int | None, by_client: bool = True) -> DramTier | None:
        """The tier, created for ``block_bytes`` if there is none yet; WireError if the sizes differ. A size a
        client's first stored block sets must be at least MIN_BLOCK_BYTES and gets at most ``max_slots``
        slots."""
        with self._lock:
            if self.tier is not None:
                if block_bytes and block_bytes != self.tier.block_bytes:
                    raise WireError(ERR_WRONG_SIZE, f"this pool holds blocks of {self.tier.block_bytes} bytes, "
                                                    f"the client's are {block_bytes} bytes (run one pool per "
                                                    "block layout)")
                return self.tier
            if not block_bytes:
                return None
            s = self.settings
            why = block_size_problem(block_bytes, s.capacity, minimum=MIN_BLOCK_BYTES if by_client else 1)
            if why:
                raise WireError(ERR_WRONG_SIZE, why)
            # The operator's --block-bytes is taken as given (kvtier replay runs pools of tiny stand-in blocks).
            capacity = min(s.capacity, max_slots(s.capacity) * block_bytes) if by_client else s.capacity
            if capacity < s.capacity:
                log.warning("pool %s: blocks of %d B would need %d slots for %s; capped at %d slots (%s) so the "
                            "per-slot bookkeeping stays under 1/%d of the memory served", self.node_id, block_bytes,
                            s.capacity // block_bytes, format_bytes(s.capacity), max_slots(s.capacity),
                            format_bytes(capacity), METADATA_SHARE)
            if self.shm_path is not None:
                self.shm_path.parent.mkdir(parents=True, exist_ok=True)
            tier = DramTier(capacity, block_bytes, policy=s.eviction,
                            shm_path=str(self.shm_path) if self.shm_path else None, pin_memory="false",
                            prefault=s.prefault, copy_threads=s.copy_threads, clock=self.policy_clock)
            tier.attach(PinTable(), lambda keys, _views: self.emit("removed", list(keys)))
            slots = tier.capacity_bytes // block_bytes
            gen_path = self.shm_path.with_suffix(".gen") if self.shm_path is not None else None
            self.generations = SlotGenerations(slots, gen_path)
            tier.watch_frees(self.generations.bump)  # a key gone from its slot: located reads miss (locations.py)
            floor = min(tier.capacity_bytes, MIN_HELD_BLOCKS * block_bytes)  # a small pool's clients need a few
            self.held.limit = max(self.held.limit, floor)
            self.held.per_account = min(self.held.limit, max(self.held.per_account, floor))
            if self.agent is not None:  # registered unsized: its events carry the block size from now on
                self.agent.block_bytes = block_bytes
            self.tier = tier
            log.info("pool %s: DRAM of %s in blocks of %d B (%d blocks), %s", self.node_id,
                     format_bytes(tier.capacity_bytes), block_bytes, slots,
                     f"shared at {self.shm_path}" if self.shm_path else "private memory")
        self._start_rdma(tier)
        return tier

    def tier_for(self, body: dict[str, Any], *, stores: bool = False) -> DramTier:
        """The tier for a data op. An op that ``stores`` data (put, reserve) sizes an unsized pool from its
        ``block_bytes``; any other op on an unsized pool answers ERR_NOT_READY (it holds nothing yet: a get's
        keys are misses to the client). Another size is refused, naming both."""
        block_bytes = wire.int_field(body, "block_bytes", 0, 1 << 34, default=0)
        tier = self.tier
        if tier is None:
            if stores and block_bytes:
                tier = self.ensure_tier(block_bytes)
            if tier is None:
                raise WireError(ERR_NOT_READY, "the pool holds nothing yet and does not know its block size "
                                               "(the first put sets it, or start it with --block-bytes)")
        if block_bytes and block_bytes != tier.block_bytes:
            self.ensure_tier(block_bytes)  # raises, naming both sizes
        return tier

    def reserve(self, tier: DramTier, keys: list[bytes]) -> Reservation:
        """``tier.reserve(keys)``, the reserved slots' generations bumped before anyone writes into them."""
        res = tier.reserve(keys)
        if res.slots and self.generations is not None:
            self.generations.bump(res.slots)
        return res

    def store(self, tier: DramTier, keys: list[bytes], rows: np.ndarray) -> Reservation:
        """A put into ``tier``: the blocks at host addresses ``rows`` (one per key) copied into the slots reserved
        for ``keys``, committed (given back if the copy fails), and a "stored" event for them."""
        res = self.reserve(tier, keys)
        try:
            if res.slots:
                copy_rows(res.addresses, rows[res.index], tier.block_bytes, self.settings.copy_threads)
        except BaseException:
            tier.commit(res, success=False)
            raise
        tier.commit(res)
        self.emit("stored", res.keys)
        return res

    def client(self, client: Client, body: dict[str, Any]) -> Client:
        """``client`` with the session its request carries, if this pool issued it (else none), and its role."""
        session = body.get("session")
        role = self.role_of(client.key) if self.role_of is not None and client.key else client.role
        if not self.sessions.check(session):
            session = b""
        if session == client.session and role == client.role:
            return client
        return Client(client.key, client.peer, session or b"", role)

    @property
    def request_bytes(self) -> int:
        """The largest request a client should send (hello tells it): a batch keeps a few in flight (lanes x
        window, about 8), and all of them fit in its share of the held budget."""
        return max(1, self.held.per_account // REQUESTS_IN_SHARE)

    def slot_of(self, tier: DramTier, address: int) -> int:
        return (address - tier.buffer.ptr) // tier.block_bytes

    def keys(self, body: dict[str, Any]) -> list[bytes]:
        blob = wire.keys_field(body, "keys", self.settings.max_keys)
        raw = blob.tobytes()
        return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]

    # ---- events, counters ------------------------------------------------------------------------------

    def emit(self, kind: str, keys: list[bytes]) -> None:
        """Tell the master (through the node agent) that the tier gained or lost keys."""
        agent = self.agent
        if agent is not None and keys:
            agent.on_event(StoreEvent(kind, TIER, keys))

    def count(self, **deltas: int) -> None:
        with self._lock:
            self.counters.update(deltas)

    def record_read(self, nbytes: int, seconds: float) -> None:
        """A served get: feeds the bandwidth the master's cost model prices this node's tier at."""
        if self.agent is not None:
            self.agent.record_transfer(nbytes, seconds, tier=TIER)

    def stats(self) -> dict[str, Any]:
        tier = self.tier
        with self._lock:
            counters = dict(self.counters)
        budgets = {b.name: {"used": b.used, "peak": b.peak, "limit": b.limit, "per_client": b.per_account,
                            "refused": b.refused, "clients": b.accounts()} for b in (self.memory, self.held)}
        return {"node": self.node_id, "epoch": self.epoch, "tier": tier.stats().__dict__ if tier else None,
                "pages": tier.buffer.pages() if tier else "",
                "leases": len(self.leases), "leases_quarantined": self.leases.quarantined,
                "leases_expired": self.leases.expired, "leases_foreign": self.leases.foreign,
                "budgets": budgets, "counters": counters}

    # ---- lifetime --------------------------------------------------------------------------------------

    def _page_label(self) -> dict[str, str]:
        """What ``kvtier status`` shows of the DRAM's pages (label PAGES_LABEL): the page size the kernel put the
        buffer on (kvtier.memory.hostmem), known from the start for a pool sized there (--block-bytes)."""
        return {PAGES_LABEL: self.tier.buffer.pages()} if self.tier is not None else {}

    def _start_agent(self) -> None:
        if not self.settings.master:
            return
        from kvtier.client import NodeAgent

        tier = self.tier
        self.agent = NodeAgent(
            self.settings.master, self.node_id, [(TIER, tier.capacity_bytes if tier else self.settings.capacity)],
            block_bytes=tier.block_bytes if tier else 0, address=self.advertised,
            labels={**self.settings.labels, **POOL_LABELS, **self._page_label()}, used=self._used,
            list_keys=self._list_keys,
            goodbye=True, heartbeat_s=self.settings.heartbeat_s, auth=self.master_keys,
            on_replicate=self.copier.on_replicate).start()
        self.copier.start()
        log.info("pool %s: reporting to master %s as %s%s", self.node_id, self.settings.master, self.advertised,
                 " (CurveZMQ)" if self.master_keys is not None else "")

    def peer_keys(self, endpoint: str) -> ClientKeys | None:
        """The keys this pool presents to another pool it copies from: its own server keypair and that pool's
        public key (auth_dir/servers/<endpoint>, else the shared server.key); none without --auth-dir."""
        if not self.settings.auth_dir:
            return None
        return ClientKeys.load(self.settings.auth_dir, endpoint, own="server")

    def _used(self) -> dict[str, int]:
        tier = self.tier
        return {TIER: tier.stats().used_bytes if tier else 0}

    def _list_keys(self, _tier: str) -> list[bytes]:
        tier = self.tier
        return tier.keys() if tier else []

    def _start_rdma(self, tier: DramTier) -> None:
        if self.settings.rdma == "off":
            return
        reason = unavailable_reason(None if self.settings.rdma == "auto" else self.settings.rdma)
        if reason:
            level = logging.INFO if self.settings.rdma == "auto" else logging.ERROR
            log.log(level, "pool %s: no RDMA (%s); serving tcp%s", self.node_id, reason,
                    " and shared memory" if self.shm_path else "")
            return
        gens = self.generations
        self.rdma = RdmaServer(tier.buffer.ptr, tier.capacity_bytes,
                               None if self.settings.rdma == "auto" else self.settings.rdma,
                               generations=(gens.address, gens.nbytes) if gens is not None else None)

    def close(self) -> None:
        """Give back every lease, stop the agent (it says goodbye to the master), free the DRAM."""
        self.leases.expire_all()
        if self.agent is not None:
            self.agent.close()
        self.copier.close()  # after the agent: no more work comes
        if self.rdma is not None:
            self.rdma.close()
        if self.tier is not None:
            self.tier.close()
        if self.generations is not None:
            self.generations.close()
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)  # clients' mappings stay valid until they re-map


def _short(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def _master_keys(settings: PoolSettings) -> ClientKeys | None:
    """The keys the pool presents to the master: its own server keypair, and the master's public key in
    auth_dir/master.key; none (plain zmq) without --auth-dir, --master or that file."""
    d = settings.auth_dir
    if not d or not settings.master or not (Path(d) / "master.key").exists():
        return None
    return ClientKeys.load(d, settings.master, own="server", server_file="master.key")


def _shm_file(shm_dir: Path, ipc: str, epoch: int) -> Path:
    """``kvtier-pool-<endpoint hash>-<epoch>.shm``; files of earlier runs on the same endpoint are removed."""
    prefix = f"kvtier-pool-{_short(ipc)}-"
    for stale in [*shm_dir.glob(prefix + "*.shm"), *shm_dir.glob(prefix + "*.gen")]:
        try:
            stale.unlink()
            log.info("removed %s, left by an earlier run of the pool on %s", stale, ipc)
        except OSError as e:
            log.warning("cannot remove %s, left by an earlier run of the pool on %s: %s", stale, ipc, e)
    return shm_dir / f"{prefix}{epoch:016x}.shm"
