"""The ops a kvtier-pool serves (kvtier/pool/protocol.py documents each): hello, contains, remove, put, get,
reserve/commit and acquire/release (one-sided clients), stats, rdma_connect.

Each takes the PoolState, the decoded request body and the request's data frames, and returns a Reply, or
raises WireError naming what is wrong. A put copies once, from the received frames into reserved slots (one
native batched copy). A get's reply frames point into the slots, which stay acquired until zmq has sent them
(``Reply.release`` runs then), unless the hits are scattered small blocks: those are gathered into staging
buffers first (kvtier.transport.frames), one copy that costs less than a zmq message per block.

Called on the pool's worker threads, several at once; the tier and the lease table are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth.roles import ADMIN, DATA, READ
from kvtier.hostcopy import copy_rows
from kvtier.pool import protocol as P
from kvtier.pool.state import PoolState
from kvtier.transport import frames as F
from kvtier.wire import ERR_BAD_REQUEST, ERR_TOO_LARGE, WireError

Body = dict[str, Any]


@dataclass
class Reply:
    """A reply body, its data frames, and what to call once zmq has sent them (release the slots or the
    staging buffers the frames point into)."""

    body: dict[str, Any]
    data: list[Any] = field(default_factory=list)
    release: Callable[[], None] | None = None


def hello(st: PoolState, body: Body, data: list[Any]) -> Reply:
    block_bytes = wire.int_field(body, "block_bytes", 0, 1 << 34, default=0)
    tier = st.ensure_tier(block_bytes or None)
    transports: dict[str, Any] = {"tcp": {}}
    if st.stream_port:
        transports["stream"] = {"port": st.stream_port}
        if st.tokens is not None:  # the data port's admission (kvtier/auth/tokens.py); this reply is encrypted
            transports["stream"]["token"] = st.tokens.issue()
    if st.shm_path is not None and tier is not None:
        transports["shm"] = {"path": str(st.shm_path), "nbytes": tier.capacity_bytes}
    if st.rdma is not None:
        transports["rdma"] = st.rdma.describe()
    return Reply({"node": st.node_id, "block_bytes": tier.block_bytes if tier else 0,
                  "capacity": tier.capacity_bytes if tier else st.settings.capacity,
                  "max_keys": st.settings.max_keys, "lease_s": st.settings.lease_s, "transports": transports})


def contains(st: PoolState, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    return Reply({"held": P.bitmap(tier.contains(st.keys(body)))})


def remove(st: PoolState, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    keys = st.keys(body)
    held = [k for k, h in zip(keys, tier.contains(keys)) if h]
    removed = tier.remove(keys)
    st.emit("removed", held)
    return Reply({"removed": removed})


def put(st: PoolState, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    keys = st.keys(body)
    bb = tier.block_bytes
    check_fits(len(keys), bb, tier.capacity_bytes)
    got = sum(len(f) for f in data)
    if got != len(keys) * bb:
        raise WireError(ERR_BAD_REQUEST, f"put of {len(keys)} keys needs {len(keys) * bb} bytes of data "
                                         f"({bb} per block), got {got} bytes in {len(data)} frames")
    try:
        src = F.rows_in(data, bb)
    except ValueError as e:
        raise WireError(ERR_BAD_REQUEST, str(e)) from None
    res = tier.reserve(keys)
    try:
        if res.slots:
            copy_rows(res.addresses, src[res.index], bb, st.settings.copy_threads)
    except BaseException:
        tier.commit(res, success=False)
        raise
    tier.commit(res)
    st.emit("stored", res.keys)
    st.count(put_blocks=len(res.keys), put_bytes=len(res.keys) * bb)
    return Reply({"held": P.bitmap(res.held)})


def get(st: PoolState, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    keys = st.keys(body)
    hold = tier.acquire(keys)
    addresses = hold.__enter__()
    try:
        hit = [a is not None for a in addresses]
        rows = np.fromiter((a for a in addresses if a is not None), dtype=np.uint64)
        frames, used = F.frames_for(rows, tier.block_bytes, st.staging, st.settings.copy_threads)
    except BaseException:
        hold.__exit__(None, None, None)
        raise
    st.count(get_hits=len(rows), get_misses=len(keys) - len(rows), get_bytes=len(rows) * tier.block_bytes)
    if used:  # gathered into staging buffers: the slots may go now, the buffers once zmq has sent them
        hold.__exit__(None, None, None)
        return Reply({"hit": P.bitmap(hit)}, frames, lambda: st.staging.give(used))
    return Reply({"hit": P.bitmap(hit)}, frames, lambda: hold.__exit__(None, None, None))


def reserve(st: PoolState, body: Body, data: list[Any]) -> Reply:
    """Reserve slots for ``keys``; first commit the leases a pipelined client piggybacks (``leases``/``oks``, as
    ``commit`` takes them: the chunks it finished copying), so commits overlap its copies. Their validity comes
    back as ``valid``."""
    tier = st.tier_for(body)
    # Commits first: a request refused for its keys must not leave the leases it carries dangling.
    committed = _commit(st, tier, body) if "leases" in body else {}
    keys = st.keys(body)
    check_fits(len(keys), tier.block_bytes, tier.capacity_bytes)
    res = tier.reserve(keys)
    fresh = np.zeros(len(keys), dtype=bool)
    fresh[res.index] = True
    lease = st.leases.add(P.RESERVE, res, lambda: tier.commit(res, success=False)) if res.slots else 0
    base = np.uint64(tier.buffer.ptr)
    return Reply({"lease": lease, "held": P.bitmap(res.held), "fresh": P.bitmap(fresh),
                  "offsets": P.offsets((res.addresses - base).astype(np.int64)), **committed})


def commit(st: PoolState, body: Body, data: list[Any]) -> Reply:
    """One lease (``lease``, ``ok``) or several at once (``leases``, ``oks``); ``valid`` (per lease for a list)
    is False where the lease had expired: its slots were taken back."""
    tier = st.tier_for(body)
    if "leases" in body:
        return Reply(_commit(st, tier, body))
    lease = wire.int_field(body, "lease", 0, 1 << 62)
    done = _commit(st, tier, {"leases": [lease], "oks": [wire.field(body, "ok", bool, True)]})
    return Reply({"published": done["published"], "valid": done["valid"][0]})


def _commit(st: PoolState, tier: Any, body: Body) -> dict[str, Any]:
    leases = _int_list(body, "leases", st.settings.max_keys)
    oks = wire.field(body, "oks", list)
    if len(oks) != len(leases) or not all(isinstance(x, bool) for x in oks):
        raise WireError(ERR_BAD_REQUEST, "field 'oks': one bool per lease")
    valid, published = [], 0
    for lease, ok in zip(leases, oks):
        res = st.leases.take(lease, P.RESERVE)
        valid.append(res is not None or lease == 0)
        if res is None:
            continue
        tier.commit(res, success=ok)
        if ok:
            published += len(res.keys)
            st.emit("stored", res.keys)
    st.count(put_blocks=published, put_bytes=published * tier.block_bytes)
    return {"published": published, "valid": valid}


def _int_list(body: Body, name: str, max_len: int) -> list[int]:
    v = wire.field(body, name, list)
    if len(v) > max_len:
        raise WireError(ERR_TOO_LARGE, f"field {name!r}: {len(v)} entries, the limit is {max_len}")
    if not all(type(x) is int and 0 <= x < 1 << 62 for x in v):  # noqa: E721 - bool is not a lease
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: expected lease numbers")
    return v


def acquire(st: PoolState, body: Body, data: list[Any]) -> Reply:
    """Acquire ``keys``; first release the leases a pipelined client piggybacks (``releases``: the chunks it
    finished copying), so a get never needs a connection of its own to release."""
    tier = st.tier_for(body)
    if "releases" in body:  # first: a request refused for its keys must not leave the leases it carries held
        for lease in _int_list(body, "releases", st.settings.max_keys):
            _release(st, lease)
    keys = st.keys(body)
    hold = tier.acquire(keys)
    addresses = hold.__enter__()
    base = tier.buffer.ptr
    offs = [-1 if a is None else a - base for a in addresses]
    hits = sum(o >= 0 for o in offs)
    lease = st.leases.add(P.ACQUIRE, hold, lambda: hold.__exit__(None, None, None)) if hits else 0
    if not hits:
        hold.__exit__(None, None, None)
    st.count(get_hits=hits, get_misses=len(keys) - hits, get_bytes=hits * tier.block_bytes)
    return Reply({"lease": lease, "offsets": P.offsets(offs)})


def release(st: PoolState, body: Body, data: list[Any]) -> Reply:
    """One lease (``lease``) or several (``leases``, what a client sends after a batch); ``valid`` is False where
    a lease had expired (for a list: whether all were live)."""
    if "leases" in body:
        return Reply({"valid": all([_release(st, lease) for lease in _int_list(body, "leases", st.settings.max_keys)])})
    return Reply({"valid": _release(st, wire.int_field(body, "lease", 0, 1 << 62))})


def _release(st: PoolState, lease: int) -> bool:
    """Give back an acquire lease; False if it had expired (or never existed)."""
    hold = st.leases.take(lease, P.ACQUIRE)
    if hold is not None:
        hold.__exit__(None, None, None)
    return hold is not None or lease == 0


def clear(st: PoolState, body: Body, data: list[Any]) -> Reply:
    tier = st.tier
    if tier is None:
        return Reply({"removed": 0})
    keys = tier.keys()
    removed = tier.remove(keys)
    st.emit("removed", keys)
    return Reply({"removed": removed})


def stats(st: PoolState, body: Body, data: list[Any]) -> Reply:
    return Reply(st.stats())


def rdma_connect(st: PoolState, body: Body, data: list[Any]) -> Reply:
    if st.rdma is None:
        raise WireError(ERR_BAD_REQUEST, "this pool serves no RDMA (no device, or started with --rdma off)")
    return Reply(st.rdma.connect(body))


def check_fits(n: int, block_bytes: int, capacity: int) -> None:
    """ERR_TOO_LARGE naming the sizes when ``n`` blocks cannot fit the pool at all."""
    why = P.too_large(n, block_bytes, capacity)
    if why:
        raise WireError(ERR_TOO_LARGE, why)


OPS: dict[str, Callable[[PoolState, Body, list[Any]], Reply]] = {
    P.HELLO: hello, P.CONTAINS: contains, P.REMOVE: remove, P.PUT: put, P.GET: get, P.RESERVE: reserve,
    P.COMMIT: commit, P.ACQUIRE: acquire, P.RELEASE: release, P.STATS: stats, P.CLEAR: clear,
    P.RDMA_CONNECT: rdma_connect,
}
NO_REPLY_OPS = {P.RELEASE, P.COMMIT}  # a request with noreply True gets no answer
# What each op needs when the pool requires keys (kvtier/auth/roles.py; checked per message by kvtier/auth/
# gate.py before a worker sees it): engines move blocks, only operators clear. hello needs DATA because its
# reply carries the data port's token, which admits puts and gets.
PERMISSIONS = {
    P.HELLO: DATA, P.CONTAINS: READ, P.STATS: READ, P.REMOVE: DATA, P.PUT: DATA, P.GET: DATA, P.RESERVE: DATA,
    P.COMMIT: DATA, P.ACQUIRE: DATA, P.RELEASE: DATA, P.RDMA_CONNECT: DATA, P.CLEAR: ADMIN,
}

