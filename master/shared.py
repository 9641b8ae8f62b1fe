"""SharedBackend: several masters serve one directory whose state lives in Redis (``--directory redis://...``).

The design, and why:

* **One log, applied by everyone.** A write a master accepts (register, heartbeat, events, inventory,
  goodbye, forget, pin, unpin, priority) is appended to a Redis stream once (redis_log.py); every master,
  the writer included, applies the stream in order with the ops' own code (commands.py) and the writer answers
  its client only once it applied the entry itself. So every master goes through the same sequence of
  states, and a client that fails over from one master to another never sees a write undone. Redis is the
  existing engine that orders and keeps the log: no replication protocol of our own, no leader election.
* **Lookups stay in memory.** Reads (lookup, cost, locate, heat, top, nodes, hints) are answered from this
  master's applied view, at the speed of a single master: that view trails the log by the time an XREAD takes
  to deliver an entry (the staleness ``kvtier bench master`` measures). Heat and route_put's promised bytes are
  counted where they happen and logged as sums once per ``HEAT_FLUSH_S`` (order-free).
* **Time is logged, not shared.** Each master watches the heartbeats it applied; a node silent past its lease
  is proposed dead (``_expire`` naming the node's beat count), and the entry kills it only if nothing was
  heard from it in between: one point of the log, every master alike, within a lease plus staleness.
  Hint expiry and forgetting dead nodes go the same way.
* **Snapshots bound the replay.** Every ``--snapshot-interval-s`` one master (a Redis lock) writes its state
  with the log position it is consistent with; the log is trimmed behind the previous snapshot. A new or
  restarted master loads the snapshot and replays the rest before it binds its socket: it answers correctly
  before it accepts a request.
* **Redis unreachable or restarted.** The master serves its view read-only (writes get ERR_UNAVAILABLE at once:
  nothing recorded, retry, maybe on another master), logs it once, sets ``kvtier_master_backend_state``, and
  freezes leases (no master can log a death). When Redis answers again: same epoch, and the entry this master
  applied last still there as it was -> go on; another epoch -> reload from Redis's snapshot. Nodes whose
  writes were refused resync with a full inventory (their sequence numbers tell).
* **Redis lost or rolled back the directory's history: the epoch.** Writes this master applied (and answered:
  nodes were told their events were in) may be gone: Redis restarted without its data or behind its last
  writes, an older RDB/AOF was restored, FLUSHALL. The epoch names the history; each master checks it, with
  the log position it applied, whenever Redis comes back and whenever its tail steps back, and a master that
  finds its last entry gone (the counter behind it, the entry missing or another) starts a new history:
  no epoch -> it re-seeds Redis with its view (one master wins; the others reload that); the same epoch ->
  it replaces the epoch and appends ``_rebase`` in one script (one master wins), then reloads. Either way the
  new history begins with every node out of sync, so every node is answered ``resync`` at its next contact
  and sends a full inventory; a master that never applied the lost entries (it trailed) just applies the
  ``_rebase`` entry as it follows the log. ``kvtier_master_directory_losses`` counts what each master found.
  The check and the rebase are shared_history.py.

Runs on the master's event loop; the Redis calls are asyncio (redis.asyncio).

Past ~400 lines on purpose: it is one state machine (starting, ok, read-only, catching up) over one log position,
whose start, tailing, writes and timer each move the same few fields (the view, the applied position, the mode,
the writes awaiting their entry); the log itself (redis_log.py) and how an entry applies (commands.py) are apart.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis.exceptions

from kvtier import wire
from kvtier.master import commands
from kvtier.master.access import Caller
from kvtier.master.metrics import MasterMetrics
from kvtier.master.nodes import DEAD
from kvtier.master.redis_log import EpochChanged, RedisLog, pack, unpack
from kvtier.master.service import MasterSettings, MasterState
from kvtier.master.shared_history import EMPTY, count_loss, history_lost, rebase
from kvtier.wire import WireError

log = logging.getLogger("kvtier.master")

Answer = Callable[[int, bytes, str, str], None]
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
OK, READ_ONLY, CATCHING_UP, STARTING = "ok", "read_only", "catching_up", "starting"
STATES = (OK, READ_ONLY, CATCHING_UP, STARTING)
HEAT_FLUSH_S = 1.0
READ_BATCH = 32  # entries per read: up to 2.5 MiB each (an inventory part), so at most ~80 MiB a read
APPEND_BATCH_BYTES = 8 << 20  # commands per append script call, by size


class _Resync(Exception):
    """This master's view no longer follows the log (a gap, a step back, another epoch): reload it."""


class SharedBackend:
    """The state of one master of a cluster sharing ``settings.directory`` (see the module doc)."""

    shared = True

    def __init__(self, settings: MasterSettings, metrics: MasterMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.url = settings.directory
        self.id = secrets.token_hex(6)  # this process; answers go to entries it appended
        self.state = self._fresh()
        self.log = RedisLog(self.url, timeout_s=min(2.0, settings.write_timeout_s))
        self.mode = STARTING
        self.epoch: str | None = None
        self.last_n = 0
        self.last_id = b"0-0"
        self._cmd = 0
        self._pending: dict[int, tuple[int, Answer, float]] = {}  # cmd -> (req_id, answer, deadline)
        self._outbox: deque[tuple[int, bytes]] = deque()
        self._flushing = False
        self._driver: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._since = time.monotonic()  # when the current mode began
        self._why = ""
        self._proposed: dict[str, tuple[int, float]] = {}  # node -> (beats proposed dead, when)
        self._next_hint_expiry = self._next_forget = self._next_heat = 0.0
        self._next_snapshot = time.monotonic() + settings.snapshot_interval_s
        self._snapshot_running = False
        self._prev_snapshot_id: bytes | None = None
        self._stepped_back = False  # the tail read an entry at or before the one applied last
        self._closing = False

    def _fresh(self) -> MasterState:
        st = MasterState(self.settings, self.metrics)
        st.backend_status = self.status
        return st

    # ---- start ---------------------------------------------------------------------------------------

    async def open(self) -> None:
        delay = 0.2
        last_log = 0.0
        while True:
            try:
                await self._check_config()
                self.epoch = await self.log.epoch()
                if self.epoch is None:
                    await self._seed(self.state)
                state, n, last = await self._load()
                break
            except REDIS_ERRORS as e:
                if time.monotonic() - last_log > 10:
                    log.warning("kvtier-master: redis at %s unreachable (%s); retrying before serving", self.url, e)
                    last_log = time.monotonic()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except _Resync as e:
                log.info("kvtier-master: the log moved while loading (%s); loading again", e)
        self._swap(state, n, last)
        self._set_mode(OK, "caught up")
        self._driver = asyncio.ensure_future(self._drive())

    async def _check_config(self) -> None:
        mine = commands.cluster_config(self.settings)
        theirs = await self.log.config()
        if theirs is not None and theirs != mine:
            diff = ", ".join(f"--{k.replace('_', '-')} {mine[k]!r} here, {theirs.get(k)!r} in the cluster"
                             for k in mine if theirs.get(k) != mine[k])
            raise ValueError(f"this master's settings differ from the other masters of {self.url} ({diff}): "
                             "masters sharing a directory must apply its log alike")

    async def _seed(self, st: MasterState) -> bool:
        """Make ``st`` (at a fresh log) the cluster's state under a new epoch; False if another master did. A
        new history: every node in ``st`` resyncs (this view may trail what another master told a node)."""
        commands.resync_all(st, "redis lost the shared directory; re-seeding it")
        meta, arrays = commands.export_state(st)
        gen, _ = await self.log.write_snapshot({**meta, "n": 0, "id": b"0-0", "by": self.id}, arrays)
        epoch = await self.log.seed(gen, commands.cluster_config(self.settings))
        if epoch is None:
            await self.log.drop_snapshot(gen)
            return False
        log.warning("kvtier-master: seeded %s with this master's state (%d keys, %d nodes), epoch %s", self.url,
                    len(st.directory), len(st.registry.nodes), epoch)
        self.epoch = epoch
        self._prev_snapshot_id = None
        return True

    async def _load(self) -> tuple[MasterState, int, bytes]:
        """A fresh state from the snapshot, caught up with the log (raises _Resync if the log moved under it)."""
        self.epoch = await self.log.epoch()
        snap = await self.log.load_snapshot()
        st, n, last = self._fresh(), 0, b"0-0"
        if snap is not None:
            meta, arrays = snap
            commands.import_state(st, meta, arrays)
            n, last = int(meta["n"]), bytes(meta["id"])
        t0 = time.monotonic()
        applied = 0
        while True:
            batch = await self.log.read(last, READ_BATCH, block=False)
            if not batch:
                break
            for eid, en, raw in batch:
                if en != n + 1:
                    raise _Resync(f"entry {en} after {n}")
                self._apply(st, raw, reload=True)
                n, last = en, eid
                applied += 1
            await asyncio.sleep(0)  # reads go on from the current view meanwhile
        log.info("kvtier-master: loaded %s: snapshot at entry %d, %d entries replayed in %.2f s; %d keys, %d nodes",
                 self.url, n - applied, applied, time.monotonic() - t0, len(st.directory), len(st.registry.nodes))
        return st, n, last

    def _swap(self, st: MasterState, n: int, last: bytes) -> None:
        st.activity = self.state.activity
        self.state, self.last_n, self.last_id = st, n, last
        self._proposed.clear()
        # The previous snapshot may be of a history Redis no longer holds: trimming behind its stream id could
        # cut entries of the current one that no snapshot covers yet. The next snapshot trims nothing.
        self._prev_snapshot_id = None

    # ---- the driver: tail the log; on trouble read-only, then recover --------------------------------

    async def _drive(self) -> None:
        delay = 0.1
        while not self._closing:
            try:
                if self.mode != OK:
                    await self._recover()
                    delay = 0.1
                await self._tail()
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as e:
                self._set_mode(READ_ONLY, f"redis unreachable: {e}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except (_Resync, EpochChanged) as e:
                self._set_mode(CATCHING_UP, str(e))
            except Exception:
                log.exception("kvtier-master: following the shared log failed; reloading")
                self._set_mode(CATCHING_UP, "internal error")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _recover(self) -> None:
        """Redis answers again (or the view fell out of step): decide whether to go on, reload, rebase or re-seed
        (the module doc's last two points)."""
        epoch = await self.log.epoch()
        if epoch is None:  # Redis lost everything: this master's view is the best left
            count_loss(self.metrics, self.url, EMPTY, "redis holds no epoch (restarted without its data, or flushed)")
            if await self._seed(self.state):
                self.last_n, self.last_id = 0, b"0-0"
                self._stepped_back = False
                self._refresh_leases()
                self._set_mode(OK, "re-seeded redis with this master's view")
                return
            epoch = await self.log.epoch()
        if epoch == self.epoch:
            lost = await history_lost(self.log, self.last_n, self.last_id, self._stepped_back)
            if lost is not None:
                count_loss(self.metrics, self.url, *lost)
                await rebase(self.log, self.epoch or "", lost[1], self.state.wall(), self.id)
            elif self.mode == READ_ONLY:
                self._refresh_leases()
                self._set_mode(OK, "redis answers again")
                return
        self._stepped_back = False
        self._set_mode(CATCHING_UP, "reloading from redis" if epoch == self.epoch else f"new epoch {epoch}")
        state, n, last = await self._load()
        self._swap(state, n, last)
        self._set_mode(OK, "reloaded")

    def _refresh_leases(self) -> None:
        """After a time when no master could log a death, every node gets a lease from now."""
        now = self.state.mono()
        for node in self.state.registry.nodes.values():
            if node.state != DEAD:
                node.last_seen = now
        self.state.registry._changed()

    async def _tail(self) -> None:
        while not self._closing and self.mode == OK:
            batch = await self.log.read(self.last_id, READ_BATCH, block=True)
            for eid, n, raw in batch:
                if n != self.last_n + 1:
                    self._stepped_back = n <= self.last_n
                    what = "a step back" if self._stepped_back else "a gap"
                    raise _Resync(f"log entry {n} after {self.last_n} ({what})")
                self._apply(self.state, raw)
                self.last_n, self.last_id = n, eid

    def _apply(self, st: MasterState, raw: bytes, reload: bool = False) -> None:
        """Apply one entry to ``st``; answer the client if this master appended it. Heat and promised-byte sums
        this master logged are in its live view already, but not in a state being reloaded (``reload``). (Heat
        is approximate at the edges: touches a snapshot holds and logs just after it count twice for a master
        that loads that snapshot, by at most one flush interval of one master's accesses.)"""
        e = unpack(raw)
        op, t, origin, cmd = e[0], e[4], e[5], e[6]
        mine = origin == self.id
        self.metrics.log_entries.labels("self" if mine else "other").inc()
        if not mine:
            self.metrics.log_staleness.observe(max(0.0, time.time() - float(t)))
        if mine and op in commands.ORIGIN_APPLIED and not reload:
            return
        if op == commands.REBASE:
            self.epoch = e[1]["epoch"]  # the history this view follows from here on (appends go under it)
        try:
            ok, body, status, error = True, commands.apply(st, e), "ok", ""
        except WireError as err:
            ok, body, status, error = False, {"code": err.code, "message": err.message}, err.code, str(err)
        except Exception as err:  # a bug in an op: every master hits it alike; answer it, keep following
            log.exception("kvtier-master: applying log entry %d (op %s) failed", self.last_n + 1, op)
            message = f"{type(err).__name__} in op {op}: {err}"[:500]
            ok, body, status, error = False, {"code": wire.ERR_INTERNAL, "message": message}, wire.ERR_INTERNAL, message
        pending = self._pending.pop(cmd, None) if mine else None
        if pending is not None:
            req_id, fn, _ = pending
            fn(req_id, wire.encode_reply(req_id, ok, body), status, error)

    # ---- writes --------------------------------------------------------------------------------------

    def submit(self, req_id: int, op: str, body: dict[str, Any], caller: Caller, answer: Answer) -> None:
        if self.mode != OK:
            err = WireError(wire.ERR_UNAVAILABLE, f"this master cannot record writes now ({self.mode}: {self._why}, "
                                                  f"for {time.monotonic() - self._since:.1f} s); nothing was "
                                                  "recorded: retry, or ask another master")
            answer(req_id, wire.encode_error(req_id, err), err.code, str(err))
            return
        self._log(commands.entry(op, body, caller, self.state.wall(), self.id, 0), (req_id, answer))

    def _log(self, e: list[Any], reply_to: tuple[int, Answer] | None = None) -> None:
        """Queue an entry for the next append (one script call per loop pass carries every queued entry)."""
        self._cmd += 1
        e[6] = self._cmd
        if reply_to is not None:
            self._pending[self._cmd] = (*reply_to, time.monotonic() + self.settings.write_timeout_s)
        self._outbox.append((self._cmd, pack(e)))
        if not self._flushing:
            self._flushing = True
            self._spawn(self._flush())

    async def _flush(self) -> None:
        try:
            while self._outbox:
                batch, size = [], 0
                while self._outbox and (not batch or size + len(self._outbox[0][1]) <= APPEND_BATCH_BYTES):
                    cmd, raw = self._outbox.popleft()
                    batch.append((cmd, raw))
                    size += len(raw)
                t0 = time.perf_counter()
                try:
                    await self.log.append(self.epoch or "", [raw for _, raw in batch])
                    self.metrics.log_append_seconds.observe(time.perf_counter() - t0)
                except (EpochChanged, *REDIS_ERRORS) as e:
                    unsure = not isinstance(e, EpochChanged)
                    self._fail([cmd for cmd, _ in batch], f"the write could not be logged ({e})"
                               + ("; it may have been recorded" if unsure else "; nothing was recorded"))
                    self._fail([cmd for cmd, _ in self._outbox], "redis is unreachable; nothing was recorded")
                    self._outbox.clear()
                    if self.mode == OK:  # the driver's tail loop sees it and recovers
                        self._set_mode(CATCHING_UP if isinstance(e, EpochChanged) else READ_ONLY, str(e))
        finally:
            self._flushing = False

    def _fail(self, cmds: list[int], why: str) -> None:
        for cmd in cmds:
            pending = self._pending.pop(cmd, None)
            if pending is not None:
                req_id, fn, _ = pending
                err = WireError(wire.ERR_UNAVAILABLE, f"{why}: retry, or ask another master")
                fn(req_id, wire.encode_error(req_id, err), err.code, str(err))

    # ---- the timer -----------------------------------------------------------------------------------

    def tick(self) -> None:
        now = time.monotonic()
        late = [cmd for cmd, (_, _, deadline) in self._pending.items() if deadline <= now]
        if late:
            self._fail(late, f"the write was not seen back in the log within {self.settings.write_timeout_s:g} s; "
                             "it may have been recorded")
        for state in STATES:
            self.metrics.backend_state.labels(state).set(1.0 if state == self.mode else 0.0)
        self.state.dirty_records()  # the records an lmdb backend would write: here the log has them already
        if self.mode != OK:
            return
        st = self.state
        for node in st.registry.silent(st.mono()):
            proposed = self._proposed.get(node.node_id)
            if proposed is None or proposed[0] != node.beats or now - proposed[1] > 1.0:
                self._proposed[node.node_id] = (node.beats, now)
                self._log(commands.entry(commands.EXPIRE, {"node": node.node_id, "incarnation": node.incarnation,
                                                           "beats": node.beats}, None, st.wall(), self.id, 0))
        if now >= self._next_hint_expiry and st.hints.next_expiry() <= st.wall():
            self._next_hint_expiry = now + 0.5
            self._log(commands.entry(commands.EXPIRE_HINTS, {}, None, st.wall(), self.id, 0))
        if now >= self._next_forget and st.registry.due_to_forget():
            self._next_forget = now + 1.0
            self._log(commands.entry(commands.FORGET_DEAD, {}, None, st.wall(), self.id, 0))
        promised = st.take_promises()
        if promised:
            self._log(commands.entry(commands.PROMISE, {"promised": promised}, None, st.wall(), self.id, 0))
        if now >= self._next_heat:
            self._next_heat = now + HEAT_FLUSH_S
            keys, counts = st.directory.take_unsent()
            step = self.settings.max_batch_keys
            for i in range(0, len(keys), step):
                self._log(commands.entry(commands.HEAT, {"keys": keys[i : i + step].tobytes(),
                                                         "counts": counts[i : i + step].astype("<u4").tobytes()},
                                         None, st.wall(), self.id, 0))
        if self.settings.snapshot_interval_s > 0 and now >= self._next_snapshot and not self._snapshot_running:
            self._next_snapshot = now + self.settings.snapshot_interval_s
            self._snapshot_running = True
            self._spawn(self._snapshot())

    async def _snapshot(self) -> None:
        try:
            if not await self.log.take_snapshot_turn(self.id, self.settings.snapshot_interval_s * 0.9):
                return
            t0 = time.perf_counter()
            n, last, epoch = self.last_n, self.last_id, self.epoch or ""
            meta, arrays = commands.export_state(self.state)  # on the loop, between two entries: consistent
            gen, nbytes = await self.log.write_snapshot({**meta, "n": n, "id": last, "by": self.id}, arrays)
            if not await self.log.publish_snapshot(gen, epoch):
                log.info("kvtier-master: shared snapshot at entry %d not published: the epoch changed", n)
                return
            if self._prev_snapshot_id is not None:
                await self.log.trim(self._prev_snapshot_id)  # one interval of slack for masters behind
            self._prev_snapshot_id = last
            self.metrics.snapshots.inc()
            log.info("kvtier-master: shared snapshot at entry %d: %d keys, %.1f MiB in %.2f s", n,
                     len(arrays["k0"]), nbytes / 2**20, time.perf_counter() - t0)
        except REDIS_ERRORS as e:
            log.warning("kvtier-master: shared snapshot not written (%s); the next interval tries again", e)
        finally:
            self._snapshot_running = False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _set_mode(self, mode: str, why: str) -> None:
        if mode == self.mode:
            return
        was, self.mode, self._why, self._since = self.mode, mode, why, time.monotonic()
        if mode == READ_ONLY:
            self.metrics.read_only.inc()
            log.warning("kvtier-master: directory READ-ONLY (%s): serving this master's view, refusing writes "
                        "with %s until redis answers", why, wire.ERR_UNAVAILABLE)
        elif mode == CATCHING_UP:
            self.metrics.reloads.inc()
            log.warning("kvtier-master: reloading the shared directory (%s); serving the current view meanwhile, "
                        "refusing writes", why)
        elif mode == OK and was != STARTING:
            log.warning("kvtier-master: directory writable again (%s) at log entry %d", why, self.last_n)

    def status(self) -> dict[str, Any]:
        return {"kind": "redis", "url": self.url, "state": self.mode,
                "since_s": round(time.monotonic() - self._since, 3),
                "why": self._why, "entry": self.last_n, "epoch": self.epoch, "master": self.id}

    async def close(self, flush: bool) -> None:
        self._closing = True
        if flush and self._outbox:
            await asyncio.sleep(0.05)  # let the last append go out
        for task in [self._driver, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._driver, *self._tasks] if t is not None), return_exceptions=True)
        self._fail(list(self._pending), "the master is shutting down")
        await self.log.close()
