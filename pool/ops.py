"""The ops a kvtier-pool serves (kvtier/wire/pool.py documents each): hello, contains, remove, put, get,
reserve/commit, acquire/release and touch (one-sided clients), stats, clear, rdma_connect, observe (what the
engines know about their agents, for the pool's eviction policy).

Each takes the PoolState, the Client that sent it (pool/clients.py: who, as far as the pool can
tell; roles hang off it), the decoded request body and the request's data frames, and returns a Reply, or
raises WireError naming what is wrong. A put copies once, from the received frames into reserved slots (one
native batched copy). A get's reply frames point into the slots, which stay acquired until zmq has sent them
(``Reply.release`` runs then), unless the hits are scattered small blocks: those are gathered into one
buffer of exactly the reply's size, one copy that costs less than a zmq message per block, when the pool's
memory budget has room for it (else the reply goes zero-copy anyway). Either way what the reply holds is
charged to the client's account until zmq lets go of it.

One-sided ops bind their leases to the client's account and session (a commit or release from anyone else
acts on nothing) and grant at most what the client's share of the ``held`` budget allows: keys past it are
answered as not reserved / missing (``quota_refused_blocks``), so no client can pin or reserve the pool empty.

Called on the pool's worker threads, several at once; the tier, the lease table and the budgets are
thread-safe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth.peercred import ipc_cred
from kvtier.auth.roles import ADMIN, DATA, READ
from kvtier.pool.clients import Client
from kvtier.pool.offers import offers
from kvtier.pool.sizing import MIN_BLOCK_BYTES, block_size_problem
from kvtier.pool.state import PoolState
from kvtier.wire import ERR_BAD_REQUEST, ERR_TOO_LARGE, WireError
from kvtier.wire import frames as F
from kvtier.wire import observations as observations_wire
from kvtier.wire import pool as P

Body = dict[str, Any]


@dataclass
class Reply:
    """A reply body, its data frames, and what to call once zmq has sent them (release the slots or the
    staging buffer the frames point into, and give their bytes back to the budgets)."""

    body: dict[str, Any]
    data: list[Any] = field(default_factory=list)
    release: Callable[[], None] | None = None


def hello(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """What the pool offers, and a session: the one the hello carries if this pool issued it (a client saying
    hello again keeps its leases), else a new one. Never sizes the pool (the first stored block does)."""
    block_bytes = wire.int_field(body, "block_bytes", 0, 1 << 34, default=0)
    tier = st.tier
    if tier is not None:
        st.ensure_tier(block_bytes or None)  # another size: refused, naming both
    elif block_bytes:
        why = block_size_problem(block_bytes, st.settings.capacity, minimum=MIN_BLOCK_BYTES)
        if why:
            raise WireError(P.ERR_WRONG_SIZE, why)
    return Reply({"node": st.node_id, "block_bytes": tier.block_bytes if tier else 0,
                  "capacity": tier.capacity_bytes if tier else st.settings.capacity,
                  "max_keys": st.settings.max_keys, "lease_s": st.settings.lease_s, "transports": offers(st, tier),
                  "request_bytes": st.request_bytes,
                  "session": st.client(client, body).session or st.sessions.issue()})


def contains(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    return Reply({"held": P.bitmap(tier.contains(st.keys(body)))})


def remove(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    keys = st.keys(body)
    held = [k for k, h in zip(keys, tier.contains(keys)) if h]
    removed = tier.remove(keys)
    st.emit("removed", held)
    return Reply({"removed": removed})


def put(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body, stores=True)
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
    res = st.store(tier, keys, src)
    st.count(put_blocks=len(res.keys), put_bytes=len(res.keys) * bb, bytes_in_zmq=got)
    return Reply({"held": P.bitmap(res.held)})


def get(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    tier = st.tier_for(body)
    keys = st.keys(body)
    bb = tier.block_bytes
    hold = tier.acquire(keys)
    addresses = hold.__enter__()
    account = client.account
    budget = None  # what the reply's bytes are charged to until zmq lets go of them
    try:
        hit = [a is not None for a in addresses]
        rows = np.fromiter((a for a in addresses if a is not None), dtype=np.uint64)
        nbytes = len(rows) * bb
        if F.should_gather(rows, bb) and st.memory.take(account, nbytes):
            budget = st.memory
            frames = F.gather(rows, bb, st.settings.copy_threads)
        else:
            budget = st.held
            st.held.charge(account, nbytes)
            frames = F.zero_copy(rows, bb)
    except BaseException:
        hold.__exit__(None, None, None)
        if budget is not None:
            budget.give(account, nbytes)
        raise
    st.count(get_hits=len(rows), get_misses=len(keys) - len(rows), get_bytes=nbytes, bytes_out_zmq=nbytes)
    if budget is st.memory:  # copied: the slots may go now, the copy once zmq has sent it
        hold.__exit__(None, None, None)
        return Reply({"hit": P.bitmap(hit)}, frames, lambda: st.memory.give(account, nbytes))

    def release() -> None:
        hold.__exit__(None, None, None)
        st.held.give(account, nbytes)
    return Reply({"hit": P.bitmap(hit)}, frames, release)


def reserve(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """Reserve slots for ``keys``; first commit the leases a pipelined client piggybacks (``leases``/``oks``, as
    ``commit`` takes them: the chunks it finished copying), so commits overlap its copies. Their validity comes
    back as ``valid``. Keys past the client's share of the held budget are not reserved (``held`` False)."""
    client = _with_session(st, client, body)
    tier = st.tier_for(body, stores=True)
    # Commits first: a request refused for its keys must not leave the leases it carries dangling.
    committed = _commit(st, client, tier, body) if "leases" in body else {}
    keys = st.keys(body)
    bb = tier.block_bytes
    check_fits(len(keys), bb, tier.capacity_bytes)
    ask, skipped = within_quota(st, client, keys, lambda: ~np.asarray(tier.contains(keys), dtype=bool), bb)
    res = st.reserve(tier, keys if ask is None else [keys[i] for i in ask])
    index = np.asarray(res.index, dtype=np.int64)
    if ask is None:
        held = np.asarray(res.held, dtype=bool)
    else:
        held = np.zeros(len(keys), dtype=bool)
        held[ask] = res.held
        index = ask[index]
    fresh = np.zeros(len(keys), dtype=bool)
    fresh[index] = True
    lease = 0
    if res.slots:
        nbytes = len(res.slots) * bb
        st.held.charge(client.account, nbytes)
        lease = st.leases.add(P.RESERVE, res, lambda: tier.commit(res, success=False), client.owner, nbytes)
    base = np.uint64(tier.buffer.ptr)
    offsets = (res.addresses - base).astype(np.int64)
    gens = st.generations.of(offsets // bb) if st.generations is not None and len(offsets) \
        else np.zeros(len(offsets), dtype=np.uint64)
    return Reply({"lease": lease, "held": P.bitmap(held), "fresh": P.bitmap(fresh), "offsets": P.offsets(offsets),
                  "generations": gens.astype("<u8").tobytes(), "skipped": skipped, **committed})


def commit(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """One lease (``lease``, ``ok``) or several at once (``leases``, ``oks``); ``valid`` (per lease for a list)
    is False where the lease had expired (its slots were taken back) or is not this client's."""
    client = _with_session(st, client, body)
    tier = st.tier_for(body)
    if "leases" in body:
        return Reply(_commit(st, client, tier, body))
    lease = wire.int_field(body, "lease", 0, 1 << 62)
    done = _commit(st, client, tier, {"leases": [lease], "oks": [wire.field(body, "ok", bool, True)]})
    return Reply({"published": done["published"], "valid": done["valid"][0]})


def _commit(st: PoolState, client: Client, tier: Any, body: Body) -> dict[str, Any]:
    leases = _int_list(body, "leases", st.settings.max_keys)
    oks = wire.field(body, "oks", list)
    if len(oks) != len(leases) or not all(isinstance(x, bool) for x in oks):
        raise WireError(ERR_BAD_REQUEST, "field 'oks': one bool per lease")
    valid, published = [], 0
    for lease, ok in zip(leases, oks):
        res = st.leases.take(lease, P.RESERVE, client.owner)
        valid.append(res is not None or lease == 0)
        if res is None:
            continue
        tier.commit(res, success=ok)
        if ok:
            published += len(res.keys)
            st.emit("stored", res.keys)
    st.count(put_blocks=published, put_bytes=published * tier.block_bytes,
             bytes_in_onesided=published * tier.block_bytes)
    return {"published": published, "valid": valid}


def _int_list(body: Body, name: str, max_len: int) -> list[int]:
    v = wire.field(body, name, list)
    if len(v) > max_len:
        raise WireError(ERR_TOO_LARGE, f"field {name!r}: {len(v)} entries, the limit is {max_len}")
    if not all(type(x) is int and 0 <= x < 1 << 62 for x in v):  # noqa: E721 - bool is not a lease
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: expected lease numbers")
    return v


def acquire(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """Acquire ``keys``; first release the leases a pipelined client piggybacks (``releases``: the chunks it
    finished copying), so a get never needs a connection of its own to release. ``generations`` are the
    acquired slots' (kvtier/wire/generations.py): the client checks them again after its copy. Keys past the
    client's share of the held budget are answered as misses."""
    client = _with_session(st, client, body)
    tier = st.tier_for(body)
    if "releases" in body:  # first: a request refused for its keys must not leave the leases it carries held
        for lease in _int_list(body, "releases", st.settings.max_keys):
            _release(st, client, lease)
    keys = st.keys(body)
    bb = tier.block_bytes
    ask, skipped = within_quota(st, client, keys, lambda: np.asarray(tier.contains(keys), dtype=bool), bb)
    hold = tier.acquire(keys if ask is None else [keys[i] for i in ask])
    got = hold.__enter__()
    base = tier.buffer.ptr
    offs = np.fromiter((-1 if a is None else a - base for a in got), dtype=np.int64, count=len(got))
    if ask is not None:
        offs, sub = np.full(len(keys), -1, dtype=np.int64), offs
        offs[ask] = sub
    found = offs >= 0
    hits = int(found.sum())
    gens = np.zeros(len(keys), dtype=np.uint64)
    if hits and st.generations is not None:
        gens[found] = st.generations.of(offs[found] // bb)
    lease = 0
    if hits:
        nbytes = hits * bb
        st.held.charge(client.account, nbytes)
        lease = st.leases.add(P.ACQUIRE, hold, lambda: hold.__exit__(None, None, None), client.owner, nbytes)
    else:
        hold.__exit__(None, None, None)
    st.count(get_hits=hits, get_misses=len(keys) - hits, get_bytes=hits * bb, bytes_out_onesided=hits * bb)
    return Reply({"lease": lease, "offsets": P.offsets(offs), "generations": gens.astype("<u8").tobytes(),
                  "skipped": skipped})


def release(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """One lease (``lease``) or several (``leases``, what a client sends after a batch); ``valid`` is False where
    a lease had expired or is not this client's (for a list: whether all were live)."""
    client = _with_session(st, client, body)
    if "leases" in body:
        leases = _int_list(body, "leases", st.settings.max_keys)
        return Reply({"valid": all([_release(st, client, lease) for lease in leases])})
    return Reply({"valid": _release(st, client, wire.int_field(body, "lease", 0, 1 << 62))})


def touch(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """Blocks a one-sided client read where it saw them last, without an acquire (kvtier/transport/locations.py:
    their slots' generations proved them unchanged): hits, and accesses for the eviction policy, as an acquire's
    would have been. Sent after the copy, with no reply."""
    tier = st.tier_for(body)
    keys = st.keys(body)
    hits = tier.touch(keys)
    bb = tier.block_bytes
    st.count(get_hits=hits, get_bytes=hits * bb, bytes_out_onesided=hits * bb, located_reads=hits)
    return Reply({"touched": hits})


def _release(st: PoolState, client: Client, lease: int) -> bool:
    """Give back an acquire lease of this client; False if it had expired, never existed or is another's."""
    hold = st.leases.take(lease, P.ACQUIRE, client.owner)
    if hold is not None:
        hold.__exit__(None, None, None)
    return hold is not None or lease == 0


def _with_session(st: PoolState, client: Client, body: Body) -> Client:
    """The client with the session its request carries; ERR_BAD_REQUEST when it carries none this pool issued
    (a lease op must say whose lease it is: a hello hands out the session)."""
    client = st.client(client, body)
    if not client.session:
        st.count(no_session=1)
        raise WireError(ERR_BAD_REQUEST, "no valid session: a lease op carries the session from this pool's "
                                         "hello reply (say hello again after a pool restart)")
    return client


def within_quota(st: PoolState, client: Client, keys: list[bytes], costs: Callable[[], np.ndarray], bb: int
                  ) -> tuple[np.ndarray | None, int]:
    """Which of ``keys`` to act on, and how many were left out: None for all of them (the client's room in the
    held budget covers every key: the common case, nothing is looked up), else the indices of every key that
    costs nothing and of as many of those that would hold a slot (``costs()`` True) as the room allows (none
    while the client holds its most leases)."""
    room = 0 if st.leases.full(client.account) else st.held.room(client.account) // bb
    if len(keys) <= room:
        return None, 0
    costly = np.flatnonzero(costs())
    if len(costly) <= room:
        return None, 0
    keep = np.ones(len(keys), dtype=bool)
    keep[costly[room:]] = False
    skipped = len(costly) - room
    st.count(quota_refused_blocks=skipped)
    return np.flatnonzero(keep), skipped


def observe(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """What a client's engine knows about its agents (arrivals, completions, hints), for the pool's policy. Its
    times are moved onto the pool's clock (by the difference of the two clocks' ``now``), or, for a pool on the
    senders' clock (``--policy-clock sender``: a replay's), taken as sent. Before the first block sized the pool
    there is no policy: taken 0."""
    now = wire.float_field(body, "now", -1e15, 1e15)
    clock = st.policy_clock
    if clock is not None:
        clock.saw(now)
        shift = None
    else:
        delta = time.monotonic() - now
        shift = lambda t: t + delta  # noqa: E731
    batch = observations_wire.decode(body, st.settings.max_keys, shift, account=client.key)
    tier = st.tier
    n = len(batch.arrivals) + len(batch.completions) + len(batch.hints)
    if tier is None or not n:
        return Reply({"taken": 0})
    tier.observe(batch)
    st.count(observations=n)
    return Reply({"taken": n})


def clear(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    tier = st.tier
    if tier is None:
        return Reply({"removed": 0})
    keys = tier.keys()
    removed = tier.remove(keys)
    st.emit("removed", keys)
    return Reply({"removed": removed})


def stats(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    return Reply(st.stats())


def rdma_connect(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    if st.rdma is None:
        raise WireError(ERR_BAD_REQUEST, "this pool serves no RDMA (no device, or started with --rdma off)")
    return Reply(st.rdma.connect(body))


def check_fits(n: int, block_bytes: int, capacity: int) -> None:
    """ERR_TOO_LARGE naming the sizes when ``n`` blocks cannot fit the pool at all."""
    why = P.too_large(n, block_bytes, capacity)
    if why:
        raise WireError(ERR_TOO_LARGE, why)


def copy_from(st: PoolState, client: Client, body: Body, data: list[Any]) -> Reply:
    """Copy blocks from another pool (pool/replicas.py): the cluster's op, never a stranger's (a copy makes this
    pool dial an endpoint the caller names and store what comes back under keys the caller names). With keys
    the role check let only an operator key through (ADMIN); without keys see ``cluster_caller_problem``."""
    source = body.get("source")
    if not isinstance(source, str) or not source or len(source) > 512:
        raise WireError(ERR_BAD_REQUEST, "copy_from needs 'source': the client endpoint of the pool to copy from")
    keys = st.keys(body)
    why = cluster_caller_problem(st, client)
    if why:
        st.copier.refuse(source, len(keys), "not_cluster", why, client.account)
    st.tier_for(body)
    copied, missing = st.copier.copy_from(source, keys, asker=client.account)  # unreachable: ERR_UNAVAILABLE
    return Reply({"copied": copied, "missing": missing})


def cluster_caller_problem(st: PoolState, client: Client) -> str | None:
    """Why ``client`` is not proven to be the cluster (None: it is). With ``--auth-dir`` the per-op role check
    already admitted only keys whose role grants ADMIN (operators). Without keys the one identity a pool has
    is the kernel's: a process of this pool's own uid on its ipc:// socket (SO_PEERCRED, as zmq reports it:
    kvtier/auth/peercred.py), which could read this pool's memory anyway; a tcp:// caller (no credentials)
    or another uid is refused."""
    if st.settings.auth_dir:
        return None
    cred = ipc_cred(client.peer)
    if cred is None:
        return ("a pool without --auth-dir takes copy_from only from a process of its own user on its ipc:// "
                f"socket; this caller came from {client.peer[:64]} (no kernel credentials)")
    if cred.uid != os.geteuid():
        return f"the caller runs as uid {cred.uid}, this pool as uid {os.geteuid()}"
    return None


Op = Callable[[PoolState, Client, Body, list[Any]], Reply]
OPS: dict[str, Op] = {
    P.HELLO: hello, P.CONTAINS: contains, P.REMOVE: remove, P.PUT: put, P.GET: get, P.RESERVE: reserve,
    P.COMMIT: commit, P.ACQUIRE: acquire, P.RELEASE: release, P.STATS: stats, P.CLEAR: clear,
    P.RDMA_CONNECT: rdma_connect, P.COPY_FROM: copy_from, P.OBSERVE: observe, P.TOUCH: touch,
}
NO_REPLY_OPS = {P.RELEASE, P.COMMIT, P.TOUCH}  # a request with noreply True gets no answer
# What each op needs when the pool requires keys (kvtier/auth/roles.py; checked per message by PoolServer.serve
# before a worker sees it): engines move blocks, only operators clear and ask for copies (copy_from: without
# keys, only a process of the pool's own uid on its ipc socket: ops.cluster_caller_problem). hello needs DATA
# because its reply carries the data port's token, which admits puts and gets.
PERMISSIONS = {
    P.HELLO: DATA, P.CONTAINS: READ, P.STATS: READ, P.REMOVE: DATA, P.PUT: DATA, P.GET: DATA, P.RESERVE: DATA,
    P.COMMIT: DATA, P.ACQUIRE: DATA, P.RELEASE: DATA, P.RDMA_CONNECT: DATA, P.CLEAR: ADMIN,
    P.COPY_FROM: ADMIN, P.OBSERVE: DATA, P.TOUCH: DATA,
}

# Ops that make a client hold more (memory or slots): the dispatcher holds them back while the client's
# account is at a budget limit (pool/dispatch.py). Leases ops grant within the quota themselves.
HOLDING_OPS = {P.GET}
