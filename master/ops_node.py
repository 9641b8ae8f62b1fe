"""The ops nodes call (through kvtier.client.NodeAgent): register, heartbeat, events, inventory.

The protocol keeps the master's view of a node exact or absent, never silently wrong:

* ``register`` (node start, or after ERR_UNKNOWN_NODE) says the node's incarnation and event sequence
  number; the reply's ``resync`` tells it to send a full ``inventory`` unless the master already applied
  exactly that sequence number of that incarnation (a master restart with a fresh snapshot, a lost reply).
* ``events`` carry one sequence number per message (ADD/REMOVE batches per tier). The next number is
  applied; a repeat is ignored; a gap drops the node's placements and answers ``resync``.
* ``inventory`` parts 0..k (``last`` on the final one) replace everything the master had for the node;
  the node is answered from again once the last part is in.
* ``heartbeat`` renews the lease and carries used bytes, measured bandwidths and RPC latency; its reply
  says ``resync`` when the master needs an inventory, and the hints version.

A dead node (lease expired) or an unknown incarnation gets ERR_UNKNOWN_NODE: it registers again. A node id
is held by the registration that made it (its incarnation, and with keys its key: nodes.py); a register or
node op for it from anyone else gets ERR_NODE_OWNED, so a stranger can neither say goodbye for a real pool
nor register over it. Every field is bounded (limits.py). With keys, only daemon keys reach these ops at
all (server.py checks ``PERMISSIONS``). Run on the master's event loop, one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvtier import wire
from kvtier.auth.roles import NODE
from kvtier.master import limits
from kvtier.master.access import ANONYMOUS, Caller
from kvtier.master.nodes import DEAD, LIVE, PENDING, SYNCING, Node
from kvtier.master.service import MasterState
from kvtier.wire import ERR_BAD_REQUEST, ERR_TOO_LARGE, WireError, field, float_field, int_field, keys_field
from kvtier.wire.pool import ENDPOINT_SCHEMES

Body = Mapping[str, Any]
MAX_SEQ = (1 << 63) - 1


def _known_node(st: MasterState, body: Body, caller: Caller) -> Node:
    node_id = limits.name(body, "node")
    incarnation = limits.text(body, "incarnation", limits.MAX_INCARNATION)
    node = st.registry.nodes.get(node_id)
    if node is None or node.state == DEAD or node.incarnation != incarnation:
        why = ("not registered" if node is None else "dead (its lease expired)" if node.state == DEAD
               else "registered with another incarnation")
        raise WireError(wire.ERR_UNKNOWN_NODE, f"node {node_id!r} is {why}; register again")
    st.registry.check_owner(node, incarnation, caller.quota, caller.permissions is not None, "node op")
    return node


def register(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    node_id = limits.name(body, "node")
    address = limits.text(body, "address", limits.MAX_ADDRESS, default="", empty=True)
    if address and not address.startswith(ENDPOINT_SCHEMES):
        raise WireError(ERR_BAD_REQUEST, f"field 'address': a node's endpoint is {' or '.join(ENDPOINT_SCHEMES)}"
                                         f"..., got {address[:64]!r}")
    incarnation = limits.text(body, "incarnation", limits.MAX_INCARNATION)
    seq = int_field(body, "seq", 0, MAX_SEQ)
    raw_tiers = field(body, "tiers", list)
    if not 0 < len(raw_tiers) <= limits.MAX_TIERS:
        raise WireError(ERR_BAD_REQUEST, f"field 'tiers': 1..{limits.MAX_TIERS} tiers, got {len(raw_tiers)}")
    tiers = []
    for i, t in enumerate(raw_tiers):
        if not (isinstance(t, list) and len(t) == 2 and type(t[1]) is int and t[1] >= 0):  # noqa: E721
            raise WireError(ERR_BAD_REQUEST, f"field 'tiers'[{i}]: expected [name, capacity_bytes]")
        tiers.append((limits.checked_str(t[0], f"field 'tiers'[{i}]: the name", limits.MAX_NAME), t[1]))
    if len({t[0] for t in tiers}) != len(tiers):
        raise WireError(ERR_BAD_REQUEST, "field 'tiers': tier names must be unique")
    labels = limits.labels(body)
    st.expire_leases()
    node, resync, retired = st.registry.register(node_id, address, tiers, labels, incarnation, seq, st.mono(),
                                                 owner=caller.quota, keyed=caller.permissions is not None)
    st.retire(retired)
    for t in node.tiers.values():
        st.metrics.node_tier(node_id, t.name, t.capacity, t.used, t.bw)
    # max_batch_keys: the largest events message or inventory part this master reads (a larger one is refused).
    return {"lease_s": st.settings.lease_s, "resync": resync, "applied_seq": node.applied_seq,
            "hints_version": st.hints.version, "max_batch_keys": st.settings.max_batch_keys}


def heartbeat(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    st.expire_leases()
    node = _known_node(st, body, caller)
    seq = int_field(body, "seq", 0, MAX_SEQ)
    used = limits.str_map(body, "used", int, limits.MAX_TIERS)
    bw = limits.str_map(body, "bw", (int, float), limits.MAX_TIERS)
    path_bw = limits.str_map(body, "path_bw", (int, float), limits.MAX_PEERS)
    latency = float_field(body, "rpc_latency_s", 0.0, 3600.0, default=0.0)
    st.registry.heard_from(node, st.mono())
    resync = False
    if node.state == PENDING:
        resync = not st.registry.confirm(node, seq)
        if resync:
            st.retire(st.registry.lose_sync(node, f"restarted master's snapshot is at seq {node.applied_seq}, "
                                                  f"the node at {seq}"))
    elif node.state == LIVE and seq != node.applied_seq:
        st.retire(st.registry.lose_sync(node, f"heartbeat at seq {seq}, master applied {node.applied_seq}"))
        resync = True
    elif node.state == SYNCING:
        resync = node.next_part is None  # not mid-inventory: the node must (re)start one
    for name, value in used.items():
        if name in node.tiers:
            node.tiers[name].used = value
            node.tiers[name].promised = 0
    for name, value in bw.items():
        if name in node.tiers and value >= 0:
            node.tiers[name].bw = float(value)
    node.path_bw = {k: float(v) for k, v in path_bw.items() if v >= 0}
    node.rpc_latency_s = latency
    for t in node.tiers.values():
        st.metrics.node_tier(node.node_id, t.name, t.capacity, t.used, t.bw)
    st.metrics.node_rpc_latency.labels(node.node_id).set(latency)
    work = st.replication.work_for(node.node_id) if st.replication is not None else {}
    work.update(st.prefetches.work_for(st, node.node_id))  # prefetch orders (master/prefetch.py)
    return {"lease_s": st.settings.lease_s, "resync": resync, "applied_seq": node.applied_seq,
            "hints_version": st.hints.version, **work}


def events(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    st.expire_leases()
    node = _known_node(st, body, caller)
    seq = int_field(body, "seq", 1, MAX_SEQ)
    batch = field(body, "events", list)
    # Check the whole message before applying any of it: a bad event must not leave half a batch applied.
    parsed = []
    total = 0
    for i, ev in enumerate(batch):
        if not (isinstance(ev, list) and len(ev) == 4):
            raise WireError(ERR_BAD_REQUEST, f"events[{i}]: expected [kind, tier, keys, block_bytes]")
        kind, tier, blob, block_bytes = ev
        if kind not in (wire.ADD, wire.REMOVE) or isinstance(kind, bool):
            raise WireError(ERR_BAD_REQUEST, f"events[{i}]: kind must be {wire.ADD} (add) or {wire.REMOVE} "
                                             "(remove)")
        if not isinstance(tier, str) or tier not in node.tiers:
            raise WireError(ERR_BAD_REQUEST, f"events[{i}]: tier {tier!r} is not one node {node.node_id!r} "
                                             f"registered ({', '.join(node.tiers)})")
        if type(block_bytes) is not int or not 0 <= block_bytes < 1 << 32:  # noqa: E721
            raise WireError(ERR_BAD_REQUEST, f"events[{i}]: block_bytes must be an int in [0, 2^32)")
        keys = keys_field({"keys": blob}, "keys", st.settings.max_batch_keys)
        total += len(keys)
        parsed.append((kind, tier, keys, block_bytes))
    if total > st.settings.max_batch_keys:
        raise WireError(ERR_TOO_LARGE, f"{total} keys in one events message, the limit is "
                                       f"{st.settings.max_batch_keys}")
    st.registry.heard_from(node, st.mono())
    if node.state == PENDING and node.applied_seq is not None:
        st.registry.confirm(node, seq - 1)  # the next event after the snapshot's: nothing was missed
    if node.state != LIVE or node.applied_seq is None:
        if node.state == PENDING:
            st.retire(st.registry.lose_sync(node, f"event seq {seq} after the snapshot's {node.applied_seq}"))
        return {"resync": node.next_part is None, "applied_seq": node.applied_seq}
    if seq <= node.applied_seq:
        return {"resync": False, "applied_seq": node.applied_seq, "duplicate": True}
    if seq != node.applied_seq + 1:
        st.retire(st.registry.lose_sync(node, f"event seq {seq} after {node.applied_seq}"))
        return {"resync": True, "applied_seq": None}
    now = st.wall()
    for kind, tier, keys, block_bytes in parsed:
        loc = node.locations[tier]
        if kind == wire.ADD:
            st.directory.add(loc, keys, block_bytes, now)
        else:
            st.directory.remove(loc, keys)
    node.applied_seq = seq
    return {"resync": False, "applied_seq": seq}


def inventory(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    st.expire_leases()
    node = _known_node(st, body, caller)
    seq = int_field(body, "seq", 0, MAX_SEQ)
    part = int_field(body, "part", 0, 1 << 31)
    last = field(body, "last", bool)
    tiers = field(body, "tiers", dict, default={})
    block_bytes = limits.str_map(body, "block_bytes", int, limits.MAX_TIERS)
    parsed = []
    total = 0
    for tier, blob in tiers.items():
        if tier not in node.tiers:
            raise WireError(ERR_BAD_REQUEST, f"inventory tier {tier!r} is not one node {node.node_id!r} "
                                             f"registered ({', '.join(node.tiers)})")
        keys = keys_field({"keys": blob}, "keys", st.settings.max_batch_keys)
        total += len(keys)
        size = block_bytes.get(tier, 0)
        if not 0 <= size < 1 << 32:
            raise WireError(ERR_BAD_REQUEST, f"block_bytes[{tier!r}] must be in [0, 2^32)")
        parsed.append((tier, keys, size))
    if total > st.settings.max_batch_keys:
        raise WireError(ERR_TOO_LARGE, f"{total} keys in one inventory part, the limit is "
                                       f"{st.settings.max_batch_keys} (send more parts)")
    if part == 0:
        st.retire(st.registry.begin_inventory(node))
        st.node_allocated(node)
    elif node.next_part != part:
        raise WireError(ERR_BAD_REQUEST, f"inventory part {part} out of order (expected "
                                         f"{node.next_part if node.next_part is not None else 0}); "
                                         "start again at part 0")
    st.registry.heard_from(node, st.mono())
    now = st.wall()
    for tier, keys, size in parsed:
        st.directory.add(node.locations[tier], keys, size, now)
    node.next_part = part + 1
    if last:
        st.registry.finish_inventory(node, seq)
        st.registry.dirty.add(node.node_id)
    return {"applied_seq": node.applied_seq, "next_part": None if last else part + 1}


def goodbye(st: MasterState, body: Body, caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """The node is leaving (a clean shutdown): its placements go now, not when its lease runs out."""
    node = _known_node(st, body, caller)
    st.retire(st.registry.leave(node))
    return {"resync": False, "applied_seq": None}


OPS: dict[str, Callable[[MasterState, Body, Caller], dict[str, Any]]] = {
    wire.REGISTER: register, wire.HEARTBEAT: heartbeat, wire.EVENTS: events, wire.INVENTORY: inventory,
    wire.GOODBYE: goodbye,
}
PERMISSIONS = {op: NODE for op in OPS}  # daemon keys only (kvtier/auth/roles.py)
