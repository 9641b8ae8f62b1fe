"""Copies of blocks from another pool into this one: hot-block replication's pool-to-pool copy.

The master (master/replication.py) hands a pool work in its heartbeat replies: "copy these keys from pool X"
and "drop these replicas". ``Copier.on_replicate`` queues the copies for one background thread (the agent's
heartbeat thread must not wait on another pool) and removes the drops at once. An operator can ask for the
same copy with the pool op ``copy_from`` {source, keys} -> {copied, missing} (pool/ops.py), which runs
it on the asking worker and answers when it is done.

A copy is a client's get from the source pool into a staging buffer, then the same reserve/copy/commit a put
runs here, with its "stored" event: the directory learns of the copy as of any block this pool stores. Keys
this pool already holds are not fetched.

**The pool never maps a peer's memory.** The get comes as bytes on a socket (``connect(shared_memory=False)``:
zmq frames over an ipc:// source, the stream, RDMA or zmq frames over tcp://), never through a shared file
the source's hello names: a process posing as a pool could name any file this pool's user can open (root's
0600 secrets) and have it copied into a block anyone can get. A source must be a tcp:// or ipc:// endpoint,
and when the master names the source node, the pool there must answer hello as that node. Each refusal is
one log line (the source, the keys' count, why) and ``copy_refused_<reason>`` (the metric
``kvtier_pool_copies_refused{reason}``). Who may ask for a copy at all is the op's check (pool/ops.py).

Bounds: one copy runs at a time (a lock), staging is at most ``STAGE_BYTES`` (or one block, when a block is
larger) and is charged to the pool's memory budget like a reply's; at most ``MAX_QUEUED`` copy jobs wait
(more are dropped, counted, and asked again by the master a few intervals later); each source call ends by
``timeout_s``. An unreachable or failing source costs that job only: logged (rate-limited), counted, the
connection dropped and made again for the next job.

Layering: here the pool is a client of another pool, so this module (and only it, on the pool's side) uses the
SDK, through its public entries alone: ``kvtier.transport.connect`` and ``kvtier.transport.PoolError``. A
failed source call leaves this module as the pool's own error, WireError ERR_UNAVAILABLE naming the source,
so the ops (and the rest of the daemon) speak kvtier.wire's errors only. The master's replication work
arrives as a NodeAgent heartbeat reply; ``ReplicationWork`` is the shape read from it (no import of the
SDK's reply type).

With ``--auth-dir`` a pool reads from another pool with its own keypair (the daemons' server.key): that key
needs the data permission on the other pools (list it under their authorized/engines/ too).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn, Protocol

import numpy as np

from kvtier import wire
from kvtier.ratelog import RateLimitedLog
from kvtier.transport import PoolConnection, PoolError, connect
from kvtier.wire import pool as P

if TYPE_CHECKING:
    from kvtier.pool.state import PoolState

log = logging.getLogger(__name__)
STAGE_BYTES = 8 << 20
MAX_QUEUED = 64
TIMEOUT_S = 5.0  # each call to a source pool
ACCOUNT = "replication"  # what the staging buffer is charged to in the pool's memory budget
# Why a copy is refused (the counter copy_refused_<reason>, the metric's label): the caller is not proven to be
# the cluster (pool/ops.py), the source is no tcp:// or ipc:// endpoint, the source is not the node named.
REFUSALS = ("not_cluster", "bad_source", "wrong_node")


class ReplicationWork(Protocol):
    """What a heartbeat reply asks of a pool (kvtier.client.NodeAgent hands its reply to ``on_replicate``):
    ``replicate`` (source node, source client endpoint, keys) triples to copy, ``drop`` replicas to remove."""

    replicate: Sequence[tuple[str, str, Sequence[bytes]]]
    drop: list[bytes]


class Copier:
    """Pool-to-pool copies for one PoolState (see the module doc). ``start()`` starts the background thread;
    ``close()`` stops it (a copy in progress ends by its timeout)."""

    def __init__(self, state: PoolState, timeout_s: float = TIMEOUT_S) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self._jobs: queue.Queue[tuple[str, list[bytes], str] | None] = queue.Queue(MAX_QUEUED)
        self._lock = threading.Lock()  # one copy at a time: the staging bound holds for all callers
        self._conns: dict[str, PoolConnection] = {}  # source address -> a connection to it
        self._thread: threading.Thread | None = None
        self._bad = RateLimitedLog(log)

    def start(self) -> Copier:
        self._thread = threading.Thread(target=self._run, name="kvtier-pool-copier", daemon=True)
        self._thread.start()
        return self

    # ---- the master's work ---------------------------------------------------------------------------

    def on_replicate(self, reply: ReplicationWork) -> None:
        """A heartbeat reply's replication work: queue its copies, remove its drops now."""
        for source_node, address, keys in reply.replicate:
            try:
                self._jobs.put_nowait((address, list(keys), source_node))
            except queue.Full:
                self.state.count(replicate_jobs_dropped=1)
        if reply.drop:
            self.drop(reply.drop)

    def drop(self, keys: list[bytes]) -> int:
        tier = self.state.tier
        if tier is None:
            return 0
        held = [k for k, h in zip(keys, tier.contains(keys)) if h]
        removed = tier.remove(held)
        self.state.emit("removed", held)
        self.state.count(replicas_dropped=removed)
        return removed

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self.copy_from(*job)
            except wire.WireError as e:  # refused or unreachable: this job's one log line (an op's: the server's)
                self._bad("copier:" + e.code, logging.WARNING, "the master's copy from %s: %s", job[0][:128], e)
            except Exception:  # noqa: BLE001 -- a bug in one copy must not end the thread
                self._bad("copier", logging.ERROR, "pool copy from %s failed", job[0], exc_info=True)

    # ---- one copy ------------------------------------------------------------------------------------

    def copy_from(self, source: str, keys: list[bytes], node: str | None = None, asker: str = "the master"
                  ) -> tuple[int, int]:
        """Copy the blocks of ``keys`` the pool at ``source`` holds into this pool: (copied, missing); ``node``:
        the node the pool there must say it is (the master's work names it); ``asker``: who asked, for the
        refusal's message (the op passes its client's account). Keys held here already count as
        copied. Raises WireError ERR_UNAVAILABLE (naming the source) when the source cannot be reached or fails:
        the client side's PoolError ends here; ERR_FORBIDDEN when the source is refused (see the module doc)."""
        if not source.startswith(P.ENDPOINT_SCHEMES):
            self.refuse(source, len(keys), "bad_source", f"not a {' or '.join(P.ENDPOINT_SCHEMES)} endpoint",
                        asker)
        try:
            return self._copy_from(source, keys, node)
        except PoolError as e:
            raise wire.WireError(wire.ERR_UNAVAILABLE, f"copy_from {source[:128]}: {e}"[:500]) from None

    def refuse(self, source: str, nkeys: int, reason: str, why: str, asker: str = "the master") -> NoReturn:
        """Count a refused copy and raise ERR_FORBIDDEN naming who asked, the source, how many keys and why: its
        one log line is the caller's (the server's for the op, ``_run``'s for the master's work)."""
        assert reason in REFUSALS, reason
        self.state.count(**{f"copy_refused_{reason}": 1})
        raise wire.WireError(wire.ERR_FORBIDDEN, f"copy_from {source[:128]!r} ({nkeys} keys) asked by "
                                                 f"{asker[:128]} refused: {why}"[:500])

    def _copy_from(self, source: str, keys: list[bytes], node: str | None) -> tuple[int, int]:
        st = self.state
        tier = st.tier
        if tier is None or not keys:
            return 0, len(keys)
        wanted = [k for k, h in zip(keys, tier.contains(keys)) if not h]
        copied, missing = len(keys) - len(wanted), 0
        if not wanted:
            return copied, missing
        bb = tier.block_bytes
        per = max(1, STAGE_BYTES // bb)
        stage_rows = min(per, len(wanted))
        with self._lock:
            if not st.memory.take(ACCOUNT, stage_rows * bb):
                st.count(replicate_refused_memory=1)
                return copied, len(wanted)
            try:
                stage = np.empty((stage_rows, bb), np.uint8)
                conn = self._connection(source, bb)
                if node is not None and conn.info.node != node:
                    self._forget(source)
                    self.refuse(source, len(keys), "wrong_node", f"the pool there says it is node "
                                f"{conn.info.node[:64]!r}, the master named {node[:64]!r}")
                for i in range(0, len(wanted), per):
                    chunk = wanted[i : i + per]
                    rows = stage.ctypes.data + np.arange(len(chunk), dtype=np.uint64) * np.uint64(bb)
                    try:
                        hits = conn.get(chunk, rows)
                    except Exception:
                        self._forget(source)
                        st.count(replicate_errors=1)
                        raise
                    got = [k for k, h in zip(chunk, hits) if h]
                    missing += len(chunk) - len(got)
                    if got:  # a put's reserve/copy/commit and "stored" event, as ops.put runs it
                        copied += sum(st.store(tier, got, rows[np.flatnonzero(hits)]).held)
            finally:
                st.memory.give(ACCOUNT, stage_rows * bb)
        st.count(replicate_copied=copied, replicate_missing=missing)
        return copied, missing

    def _connection(self, source: str, block_bytes: int) -> PoolConnection:
        conn = self._conns.get(source)
        if conn is None:
            conn = connect(source, block_bytes, timeout_s=self.timeout_s, auth=self.state.peer_keys(source),
                           shared_memory=False)  # bytes on a socket: never map a file a peer names
            self._conns[source] = conn
        return conn

    def _forget(self, source: str) -> None:
        conn = self._conns.pop(source, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        if self._thread is not None:
            while True:  # make room for the stop sign: queued copies are given up
                try:
                    self._jobs.put_nowait(None)
                    break
                except queue.Full:
                    try:
                        self._jobs.get_nowait()
                    except queue.Empty:
                        pass
            self._thread.join(self.timeout_s + 1.0)
        with self._lock:
            for source in list(self._conns):
                self._forget(source)


__all__ = ["REFUSALS", "Copier", "ReplicationWork", "STAGE_BYTES", "TIMEOUT_S"]
