"""The shared log's commands: what an entry holds, how every master applies it, and the snapshot of a state.

An entry is ``[op, body, key, keyed, t, origin, cmd]``: a write request as a client sent it (op, its decoded
body), who sent it (the CurveZMQ key quotas count by, and whether the master requires keys), when the master
that accepted it did (unix time ``t``), and that master's id and command number (so it can answer the client
once it applied the entry itself). Every master applies every entry with the op's own code (ops_node.py,
ops_router.py) while ``state.command_time`` is ``t``: same log, same order, same settings -> same state, and the
same answer (including the refusals: a node id owned by another registration, a full node table, a quota).
Fields were bounded by zmq's message limit before the append and are checked by the op at apply.

Besides client writes, masters log what their own clocks decide, so that it happens at one point of the log
for everyone (``INTERNAL``): a node's lease expiry (``_expire``: only if the node was not heard from since the
proposer looked), hint expiry, forgetting dead nodes, and a new epoch (``_rebase``: the log lost entries a master
had applied, so every node resyncs). Heat and route_put's promised bytes are additive and
order-free: the master that counts them applies them at once and logs the sums (``_heat``, ``_promise``); the
others apply them when they read them, and the origin skips its own.

``export_state`` / ``import_state``: a state's whole content for a snapshot (nodes with their location
numbers, hints, prefetch orders waiting for their node, the directory's columns, the heat clock). Pure functions
over a MasterState, on its loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.master import ops_node, ops_router
from kvtier.master.access import ANONYMOUS_QUOTA, Caller
from kvtier.master.hints import HintTable
from kvtier.master.nodes import DEAD
from kvtier.master.persist import _hint_entry, _hint_value
from kvtier.master.service import MasterSettings, MasterState
from kvtier.keys.table import as_key_array

OPS = {**ops_router.OPS, **ops_node.OPS}
EXPIRE, EXPIRE_HINTS, FORGET_DEAD, HEAT, PROMISE = "_expire", "_expire_hints", "_forget_dead", "_heat", "_promise"
REBASE = "_rebase"
ORIGIN_APPLIED = frozenset({HEAT, PROMISE})  # the master that logged these applied them already

# The settings that decide how an entry applies: masters of one cluster must agree on all of them.
CLUSTER_SETTINGS = ("lease_s", "heat_half_life_s", "max_batch_keys", "max_nodes", "max_nodes_per_client",
                    "max_locations", "forget_dead_s", "max_hint_keys", "max_hint_sessions", "max_hints_per_client")


def cluster_config(settings: MasterSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in CLUSTER_SETTINGS}


def entry(op: str, body: dict[str, Any], caller: Caller | None, t: float, origin: str, cmd: int) -> list[Any]:
    key = caller.quota if caller is not None else ANONYMOUS_QUOTA
    keyed = caller is not None and caller.permissions is not None
    return [op, body, key, keyed, t, origin, cmd]


def apply(st: MasterState, e: list[Any]) -> dict[str, Any]:
    """Apply one entry to ``st``; the reply body for the client (raises WireError as the op would)."""
    op, body, key, keyed, t, _origin, _cmd = e
    st.command_time = float(t)
    try:
        internal = INTERNAL.get(op)
        if internal is not None:
            return internal(st, body)
        handler = OPS.get(op)
        if handler is None:
            raise wire.WireError(wire.ERR_UNKNOWN_OP, f"unknown op {str(op)[:64]!r} in the shared log")
        caller = Caller(key if key != ANONYMOUS_QUOTA else "", frozenset() if keyed else None)
        return handler(st, body, caller)
    finally:
        st.command_time = None


# ---- what masters' clocks decide ------------------------------------------------------------------------

def _expire(st: MasterState, body: dict[str, Any]) -> dict[str, Any]:
    node = st.registry.nodes.get(body["node"])
    if node is None or node.state == DEAD or node.incarnation != body["incarnation"] or node.beats != body["beats"]:
        return {"expired": False}  # heard from since the proposer looked (or gone already)
    st.metrics.lease_expiries.inc()
    st.retire(st.registry.leave(node, f"lease expired (silent past {st.settings.lease_s:g} s)"))
    return {"expired": True}


def _expire_hints(st: MasterState, body: dict[str, Any]) -> dict[str, Any]:
    return {"changed": st.hints.expire(st.wall())}


def _forget_dead(st: MasterState, body: dict[str, Any]) -> dict[str, Any]:
    return {"forgotten": st.registry.forget_dead()}


def resync_all(st: MasterState, why: str) -> int:
    """A new history of the directory begins (``_rebase``, or a re-seed of an emptied Redis): every node's
    placements go, and each node is answered ``resync`` at its next contact. The number of such nodes."""
    before = sum(n.state != DEAD for n in st.registry.nodes.values())
    st.retire(st.registry.lose_sync_all(why))
    return before


def _rebase(st: MasterState, body: dict[str, Any]) -> dict[str, Any]:
    """Logged (with a new epoch) by the master that found the log lost or rewrote entries it had applied:
    writes its nodes were told of are gone, so every node sends a full inventory."""
    return {"resyncing": resync_all(st, f"the shared directory's history was rolled back: {body['why']}; new "
                                        f"epoch {body['epoch']}")}


def _heat(st: MasterState, body: dict[str, Any]) -> dict[str, Any]:
    keys = as_key_array(body["keys"])
    counts = np.frombuffer(body["counts"], "<u4")
    if len(counts) == len(keys):
        st.directory.touch_counts(keys, counts, st.wall())
    return {}


def _promise(st: MasterState, body: dict[str, Any]) -> dict[str, Any]:
    for node_id, tiers in body["promised"].items():
        node = st.registry.nodes.get(node_id)
        for tier, nbytes in tiers.items():
            if node is not None and tier in node.tiers:
                node.tiers[tier].promised += int(nbytes)
    return {}


INTERNAL: dict[str, Callable[[MasterState, dict[str, Any]], dict[str, Any]]] = {
    EXPIRE: _expire, EXPIRE_HINTS: _expire_hints, FORGET_DEAD: _forget_dead, HEAT: _heat, PROMISE: _promise,
    REBASE: _rebase,
}


# ---- snapshots --------------------------------------------------------------------------------------------

def export_state(st: MasterState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays): everything a master needs to continue from this point of the log."""
    meta = {"t0": st.directory.clock.t0, "nodes": st.registry.export(), "hints_version": st.hints.version,
            "hints": [_hint_value(c) for c in st.hints.entries()], "prefetches": st.prefetches.export(),
            "saved_at": st.wall()}
    return meta, st.directory.export()


def import_state(st: MasterState, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Load a snapshot into a fresh state (nodes not dead get a lease from now)."""
    s = st.settings
    st.hints = HintTable.from_entries([_hint_entry(v) for v in meta["hints"]], meta["hints_version"],
                                      s.max_hint_keys, s.max_hint_sessions, s.max_hints_per_client)
    st.prefetches.load(meta.get("prefetches", {}))  # a snapshot from before prefetch orders: none
    st.directory.clock.t0 = meta["t0"]
    if arrays:
        st.directory.restore(arrays)
    st.registry.load_export(meta["nodes"], st.mono())
    st.directory.retire(st.registry.adopt_orphans(st.directory.present_locations()))
    st.directory.ensure_locations(st.registry.location_count)
