"""The ops routers and operators call: ping, lookup, cost, route_put, heat, top, nodes, pin, unpin, priority,
hints, prefetch (master/prefetch.py), and the operators' forget. Each takes the MasterState, a request body
(already msgpack-decoded) and the Caller (access.py), and returns the reply body, or raises WireError naming the
bad field. Field layouts are documented in kvtier/client/api.py, which builds these requests; every field is
bounded (limits.py), and ``PERMISSIONS`` says which permission each op needs when the master requires keys
(kvtier/auth/roles.py).

Run on the master's event loop, one at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth.roles import ADMIN, DATA, HINTS, READ
from kvtier.master import limits
from kvtier.master.access import ANONYMOUS, Caller
from kvtier.master.cost import CostRequest, RestorePoints
from kvtier.master.directory import location_words
from kvtier.master.placement import PlacementError, PlacementRequest, known_placements
from kvtier.master.prefetch import prefetch
from kvtier.master.replication import choose_holders
from kvtier.master.nodes import DEAD
from kvtier.master.service import MasterState
from kvtier.wire import ERR_BAD_REQUEST, WireError, field, float_field, int_field, keys_field

log = logging.getLogger(__name__)
Body = Mapping[str, Any]
MAX_TOP = 100_000
MAX_TTL_S = 10 * 365 * 86400.0


def ping(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    return {"version": wire.VERSION, "uptime_s": st.mono() - st.started, "keys": len(st.directory),
            "directory_bytes": st.directory.nbytes, "nodes": st.registry.counts(),
            "locations": st.registry.location_count, "lease_s": st.settings.lease_s,
            "activity": st.activity.view(), "backend": st.backend_status()}


def lookup(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """For each live node and tier, how many leading ``keys`` it holds; ``any``: leading keys held anywhere."""
    keys = keys_field(body, "keys", st.settings.max_batch_keys)
    touch = field(body, "touch", bool, True)
    slots, masks = st.directory.masks(keys, st.live_mask())
    held = masks.any(axis=1)
    counts = st.directory.prefix_counts(masks, held)
    st.activity.lookup(len(keys), counts.any)
    if touch:
        st.touch(slots[held])
    prefix = []
    for loc, n in sorted(counts.by_location.items(), key=lambda kv: -kv[1]):
        owner = st.registry.owner(loc)
        if owner is not None:
            prefix.append([owner[0], owner[1], n])
    return {"n": len(keys), "any": counts.any, "prefix": prefix}


def cost(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """Per candidate worker: prefix tokens per local tier, remote tokens, load and recompute seconds, and
    the cheapest load-then-recompute plan (see master/cost.py)."""
    keys = keys_field(body, "keys", st.settings.max_batch_keys)
    candidates = limits.str_list(body, "candidates", limits.MAX_CANDIDATES)
    model = field(body, "model", dict)
    try:
        bt = int_field(model, "block_tokens", 1, 1 << 20)
        rate = float_field(model, "prefill_tokens_per_s", 1e-3, 1e12)
        prompt = int_field(model, "prompt_tokens", 0, 1 << 40, default=len(keys) * bt)
    except WireError as e:
        raise WireError(e.code, f"model: {e.message}") from None
    if prompt < len(keys) * bt:
        raise WireError(ERR_BAD_REQUEST, f"model: prompt_tokens {prompt} is less than {len(keys)} keys x "
                                         f"block_tokens {bt}")
    live = st.live_mask()
    slots, masks = st.directory.masks(keys, live)
    held = masks.any(axis=1)
    prefix_len = len(keys) if held.all() else int(np.argmin(held))
    restore, touched = None, [slots[held]]
    if body.get("checkpoints") is not None:  # a hybrid prompt: only its held restore points count
        restore, prefix_len, obj_slots = _restore_points(st, body, len(keys), prefix_len, live)
        touched.append(obj_slots)
    if field(body, "touch", bool, True):
        st.touch(np.concatenate(touched))
    plans = st.cost.plans(masks, st.directory.block_bytes(slots), prefix_len, candidates,
                          CostRequest(bt, rate, prompt), restore)
    return {"n": len(keys), "prefix_blocks": prefix_len, "plans": plans}


def _restore_points(st: MasterState, body: Body, n: int, prefix_len: int,
                    live: np.ndarray) -> tuple[RestorePoints, int, np.ndarray]:
    """A hybrid prompt's ``checkpoints`` ({"at": [boundary blocks, ascending], "counts": [objects per boundary],
    "keys": the objects' keys, boundary by boundary}) -> (the restore points held within the held prefix, the
    deepest of them: the prefix a plan may load, the held objects' slots). A boundary one of whose objects no
    live node holds is no restore point."""
    cp = field(body, "checkpoints", dict)
    try:
        at = limits.int_list(cp, "at", limits.MAX_CHECKPOINTS, 1, n)
        counts = limits.int_list(cp, "counts", limits.MAX_CHECKPOINTS, 1, st.settings.max_batch_keys)
        obj_keys = keys_field(cp, "keys", st.settings.max_batch_keys)
    except WireError as e:
        raise WireError(e.code, f"checkpoints: {e.message}") from None
    if len(at) != len(counts) or any(b <= a for a, b in zip(at, at[1:])):
        raise WireError(ERR_BAD_REQUEST, "checkpoints: 'at' must ascend and have one 'counts' entry per boundary")
    if sum(counts) != len(obj_keys):
        raise WireError(ERR_BAD_REQUEST, f"checkpoints: 'counts' add up to {sum(counts)}, 'keys' has "
                                         f"{len(obj_keys)} keys")
    slots, masks = st.directory.masks(obj_keys, live)
    owner = np.repeat(np.arange(len(at)), counts)
    held = masks.any(axis=1)
    whole = np.ones(len(at), bool)
    np.logical_and.at(whole, owner, held)
    at_arr = np.asarray(at, np.int64)
    ok = whole & (at_arr <= prefix_len)
    keep = ok[owner]
    index = np.cumsum(ok) - 1  # old boundary index -> index among the restore points kept
    restore = RestorePoints(at_arr[ok], index[owner[keep]], masks[keep], st.directory.block_bytes(slots[keep]))
    return restore, int(at_arr[ok][-1]) if ok.any() else 0, slots[held]


def route_put(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """Target (node, tier) per block to store, from the placement policy (``policy`` or the daemon's)."""
    sizes = field(body, "sizes", list)
    if len(sizes) > st.settings.max_batch_keys:
        raise WireError(wire.ERR_TOO_LARGE, f"field 'sizes': {len(sizes)} blocks, the limit is "
                                            f"{st.settings.max_batch_keys}")
    if not all(type(s) is int and 0 < s < 1 << 40 for s in sizes):  # noqa: E721 - bool is not a size
        raise WireError(ERR_BAD_REQUEST, "field 'sizes': expected positive integers (block bytes)")
    keys = keys_field(body, "keys", st.settings.max_batch_keys, default=None)
    if keys is not None and len(keys) != len(sizes):
        raise WireError(ERR_BAD_REQUEST, f"'keys' has {len(keys)} keys for {len(sizes)} sizes")
    requester = limits.text(body, "requester", limits.MAX_NAME, default=None)
    spec = limits.text(body, "policy", limits.MAX_POLICY, default=None)
    labels = limits.labels(body)
    # Over the wire only registered names: an import path would let any client make the daemon import (and
    # run) an arbitrary module. Import paths are for the operator's --placement.
    if spec is not None and spec != st.settings.placement and spec not in known_placements():
        raise WireError(ERR_BAD_REQUEST, f"field 'policy': unknown placement policy {spec[:64]!r}; known: "
                                         f"{', '.join(known_placements())}")
    try:
        policy = st.placement(spec)
    except ValueError as e:
        raise WireError(ERR_BAD_REQUEST, str(e)) from None
    st.expire_leases()
    nodes = [n for n in st.registry.live_nodes() if _has_labels(n.labels, labels)]
    try:
        targets = policy.place(PlacementRequest(np.asarray(sizes, np.int64), keys, requester), nodes)
    except PlacementError as e:
        raise WireError(ERR_BAD_REQUEST, str(e)) from None
    for target, size in zip(targets, sizes):
        if target is not None:
            st.promise(target[0], target[1], size)
    return {"targets": [list(t) if t is not None else None for t in targets],
            "placed": sum(t is not None for t in targets)}


def locate(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """Per key, one live (node, tier) holding it (among several: master/replication.py), among the nodes whose labels
    include ``labels``: ``holders`` lists [node, tier, address], ``where`` indexes it per key (-1: held by none)."""
    keys = keys_field(body, "keys", st.settings.max_batch_keys)
    labels = limits.labels(body)
    live = st.live_mask()
    if labels:
        live = live & location_words([loc for n in st.registry.live_nodes() if _has_labels(n.labels, labels)
                                      for loc in n.locations.values()], len(live))
    slots, masks = st.directory.masks(keys, live)
    if field(body, "touch", bool, True):  # a store about to read these from a pool: the accesses replication counts
        st.touch(slots[(masks != 0).any(axis=1)])
    locs = choose_holders(st, keys, masks)  # among replicas: by measured bandwidth, stable per key
    holders: list[list[str]] = []
    index: dict[int, int] = {}
    where = []
    for loc in locs.tolist():
        if loc >= 0 and loc not in index:
            owner = st.registry.owner(loc)
            index[loc] = -1 if owner is None else len(holders)
            if owner is not None:
                holders.append([owner[0], owner[1], st.registry.nodes[owner[0]].address])
        where.append(index[loc] if loc >= 0 else -1)
    return {"holders": holders, "where": where}


def _has_labels(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def heat(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    keys = keys_field(body, "keys", st.settings.max_batch_keys)
    count, h, last = st.directory.heat(keys, st.wall())
    return {"count": count.tolist(), "heat": h.tolist(), "last": last.tolist()}


def top(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    n = int_field(body, "n", 1, MAX_TOP)
    keys, h, count, last = st.directory.top(n, st.wall())
    return {"keys": wire.pack_keys(keys), "heat": h.tolist(), "count": count.tolist(), "last": last.tolist()}


def nodes(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    st.expire_leases()
    now = st.mono()
    return {"nodes": [n.view(now, st.settings.lease_s) for n in st.registry.nodes.values()]}


def _hint_target(st: MasterState, body: Body) -> tuple[list[bytes], str | None]:
    keys = keys_field(body, "keys", st.settings.max_batch_keys, default=None)
    session = limits.text(body, "session", limits.MAX_SESSION, default=None)
    if keys is None and session is None:
        raise WireError(ERR_BAD_REQUEST, "give 'keys' or 'session' (or both)")
    return (wire.unpack_keys(keys.tobytes()) if keys is not None else []), session


def pin(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    keys, session = _hint_target(st, body)
    ttl = float_field(body, "ttl_s", 0.0, MAX_TTL_S, default=0.0)
    n = st.hints.pin(keys, session, ttl, st.wall(), caller.quota)
    return {"count": n, "version": st.hints.version}


def unpin(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    keys, session = _hint_target(st, body)
    n = st.hints.unpin(keys, session)
    return {"count": n, "version": st.hints.version}


def priority(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    keys, session = _hint_target(st, body)
    level = int_field(body, "level", -(1 << 31), (1 << 31) - 1)
    ttl = float_field(body, "ttl_s", 0.0, MAX_TTL_S, default=0.0)
    n = st.hints.set_priority(keys, session, level, ttl, st.wall(), caller.quota)
    return {"count": n, "version": st.hints.version}


def hints(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    since = int_field(body, "since", -1, 1 << 62, default=-1)
    st.expire_hints()
    if since == st.hints.version:
        return {"version": since, "unchanged": True}
    return st.hints.to_wire()


def forget(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """An operator drops a node now: its placements, its record here and on disk (a node that is not dead is
    made dead first; if it is still running it registers again, as after a lease expiry)."""
    node_id = limits.name(body, "node")
    node = st.registry.nodes.get(node_id)
    if node is None:
        return {"forgotten": False}
    if node.state != DEAD:
        st.retire(st.registry.leave(node, "forgotten by an operator"))
    st.retire(st.registry.forget(node))
    log.info("node %s forgotten by an operator", node_id)
    return {"forgotten": True}


OPS: dict[str, Callable[[MasterState, Body, Caller], dict[str, Any]]] = {
    wire.PING: ping, wire.LOOKUP: lookup, wire.COST: cost, wire.ROUTE_PUT: route_put, wire.HEAT: heat,
    wire.TOP: top, wire.NODES: nodes, wire.PIN: pin, wire.UNPIN: unpin, wire.PRIORITY: priority,
    wire.HINTS: hints, wire.LOCATE: locate, wire.FORGET: forget, wire.PREFETCH: prefetch,
}
PERMISSIONS = {
    wire.PING: READ, wire.LOOKUP: READ, wire.COST: READ, wire.LOCATE: READ, wire.HEAT: READ, wire.TOP: READ,
    wire.NODES: READ, wire.HINTS: READ, wire.ROUTE_PUT: DATA, wire.PIN: HINTS, wire.UNPIN: HINTS,
    wire.PRIORITY: HINTS, wire.PREFETCH: HINTS, wire.FORGET: ADMIN,
}
