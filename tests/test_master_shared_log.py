"""The shared log's invariant (master/commands.py), as a property: any master that applies the same entries
reaches the same state and gives the same answers, whether it applied them all from the start or loaded a
snapshot taken at any point and replayed the rest (what a new or restarted master does), and whatever its own
clock says. Random sequences of registrations, inventories, events, heartbeats, goodbyes, hints, prefetch orders,
logged expiries, heat and new epochs, applied in-process to MasterStates (no Redis: the log's transport is tested
with real processes in test_master_redis.py)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.master import commands
from kvtier.master.directory import mask_locations
from kvtier.master.service import MasterSettings, MasterState
from kvtier.keys.table import key_bytes

NODES = ["a", "b", "c"]
KEYS = [bytes([i]) * 16 for i in range(1, 25)]
SETTINGS = dict(directory="redis://unused", lease_s=10.0, max_nodes=2, max_locations=4, max_hint_keys=6,
                max_hint_sessions=3, forget_dead_s=50.0)


def entry_for(action: tuple, t: float) -> list:
    kind, node, inc, x, y = action
    incarnation = f"{node}-{inc}"
    keys = [KEYS[(x + i) % len(KEYS)] for i in range(y % 6 + 1)]
    body: dict
    if kind == "register":
        op, body = wire.REGISTER, {"node": node, "incarnation": incarnation, "seq": x % 3, "address": "tcp://h:1",
                                   "tiers": [["dram", 1 << 30], ["ssd", 1 << 32]][: 1 + y % 2], "labels": {}}
    elif kind == "inventory":
        op, body = wire.INVENTORY, {"node": node, "incarnation": incarnation, "seq": x % 3, "part": 0, "last": True,
                                    "tiers": {"dram": wire.pack_keys(keys)}, "block_bytes": {"dram": 4096}}
    elif kind == "events":
        op, body = wire.EVENTS, {"node": node, "incarnation": incarnation, "seq": x % 4 + 1,
                                 "events": [[y % 2, "dram", wire.pack_keys(keys), 4096]]}
    elif kind == "heartbeat":
        op, body = wire.HEARTBEAT, {"node": node, "incarnation": incarnation, "seq": x % 4,
                                    "used": {"dram": y * 4096}, "bw": {"dram": 1e9 + y}, "path_bw": {},
                                    "rpc_latency_s": 0.001}
    elif kind == "goodbye":
        op, body = wire.GOODBYE, {"node": node, "incarnation": incarnation}
    elif kind == "pin":
        op, body = wire.PIN, {"keys": wire.pack_keys(keys[:2]), "session": f"s{x % 4}", "ttl_s": float(y % 3) * 20}
    elif kind == "unpin":
        op, body = wire.UNPIN, {"session": f"s{x % 4}"}
    elif kind == "prefetch":
        # To the next node: keys another node holds in its DRAM are below this one's top tier (accepted).
        op, body = wire.PREFETCH, {"node": NODES[(NODES.index(node) + 1) % len(NODES)], "keys": wire.pack_keys(keys),
                                   "session": f"s{x % 2}",
                                   "ttl_s": float(y % 3) * 2 + 0.5}
    elif kind == "expire":
        op, body = commands.EXPIRE, {"node": node, "incarnation": incarnation, "beats": y % 4}
    elif kind == "expire_hints":
        op, body = commands.EXPIRE_HINTS, {}
    elif kind == "forget_dead":
        op, body = commands.FORGET_DEAD, {}
    elif kind == "rebase":
        op, body = commands.REBASE, {"epoch": f"e{x}", "why": "test"}
    else:
        counts = np.full(len(keys), y % 5 + 1, "<u4")
        op, body = commands.HEAT, {"keys": wire.pack_keys(keys), "counts": counts.tobytes()}
    return commands.entry(op, body, None, t, "origin", 0)


actions = st.lists(st.tuples(st.sampled_from(["register", "inventory", "events", "heartbeat", "goodbye", "pin",
                                              "unpin", "prefetch", "expire", "expire_hints", "forget_dead", "heat",
                                              "rebase"]),
                             st.sampled_from(NODES), st.integers(0, 1), st.integers(0, 30), st.integers(0, 30)),
                   min_size=1, max_size=60)


def fresh(clock_start: float) -> MasterState:
    clock = itertools.count(clock_start)  # each master's own clock: different, and never consulted by apply
    return MasterState(MasterSettings(**SETTINGS), mono=lambda: float(next(clock)), wall=lambda: float(next(clock)))


def apply_all(state: MasterState, entries: list) -> list:
    out = []
    for e in entries:
        try:
            out.append(("ok", commands.apply(state, e)))
        except wire.WireError as err:
            out.append((err.code, err.message))
    return out


def view(state: MasterState) -> dict:
    """What clients can observe, with location numbers translated to (node, tier)."""
    d = state.directory
    live = d.table.live_slots()
    placements = {}
    for slot in live.tolist():
        key = key_bytes(np.array([[d.table.k0[slot], d.table.k1[slot]]], np.uint64))[0]
        held = sorted(state.registry.owner(loc) for loc in mask_locations(d.table.column("mask")[slot])
                      if state.registry.owner(loc) is not None)
        placements[key] = held
    count, heat, last = d.heat(np.frombuffer(b"".join(KEYS), "<u8").reshape(-1, 2), 1e6)
    nodes = {n.node_id: (n.state, n.incarnation, n.applied_seq, n.next_part, n.beats, n.dead_at, n.owner,
                         sorted(n.locations),
                         [(t.name, t.capacity, t.used, t.bw, t.promised) for t in n.tiers.values()])
             for n in state.registry.nodes.values()}
    return {"placements": {k: v for k, v in placements.items() if v}, "nodes": nodes,
            "hints": state.hints.to_wire(), "prefetches": state.prefetches.export(), "count": count.tolist(),
            "heat": np.round(heat, 3).tolist(), "last": last.tolist()}


@settings(max_examples=60, deadline=None)
@given(actions, st.integers(0, 60), st.floats(1e6, 2e6))
def test_a_master_loaded_from_any_snapshot_reaches_the_same_state_as_one_that_applied_everything(seq, cut, t0):
    entries = [entry_for(a, t0 + i) for i, a in enumerate(seq)]
    cut = min(cut, len(entries))
    whole = fresh(0.0)
    answers = apply_all(whole, entries)
    other = fresh(5000.0)  # another master, another clock: same answers
    assert apply_all(other, entries) == answers
    loaded = from_snapshot_at(entries, cut)
    assert apply_all(loaded, entries[cut:]) == answers[cut:]
    assert view(loaded) == view(whole) == view(other)


def from_snapshot_at(entries: list, cut: int):
    """A master's state that applied ``entries[:cut]`` on one clock, exported, and imported by another master."""
    first = fresh(10.0)
    apply_all(first, entries[:cut])
    meta, arrays = commands.export_state(first)
    loaded = fresh(9000.0)
    commands.import_state(loaded, meta, {k: v.copy() for k, v in arrays.items()})
    return loaded


PRELUDE = [("register", "a", 0, 0, 0), ("inventory", "a", 0, 0, 5), ("register", "b", 0, 0, 0),
           ("inventory", "b", 0, 20, 0)]  # a holds keys 0-5 in DRAM, b key 20: orders to b for a's are accepted
prefetch_actions = st.lists(st.tuples(st.sampled_from(["prefetch", "prefetch", "heartbeat", "goodbye", "expire",
                                                       "register", "inventory", "rebase"]),
                                      st.sampled_from(NODES[:2]), st.integers(0, 1), st.integers(0, 30),
                                      st.integers(0, 30)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(prefetch_actions, st.integers(0, 44), st.floats(1e6, 2e6))
def test_prefetch_orders_waiting_for_their_node_are_the_same_on_every_master(seq, cut, t0):
    """Orders a node has not collected yet (master/prefetch.py) are in the snapshot: a master that loaded it hands
    the node the same orders in its heartbeat replies as one that applied everything."""
    entries = [entry_for(a, t0 + i) for i, a in enumerate(PRELUDE + seq)]
    for e in entries:
        if e[0] == wire.REGISTER:
            e[1]["address"] = f"tcp://{e[1]['node']}:1"  # each node its own endpoint: both live at once
    cut = min(cut, len(entries))
    whole = fresh(0.0)
    answers = apply_all(whole, entries)
    loaded = from_snapshot_at(entries, cut)
    assert apply_all(loaded, entries[cut:]) == answers[cut:]
    assert view(loaded) == view(whole)


@settings(max_examples=60, deadline=None)
@given(actions, st.floats(1e6, 2e6))
def test_after_a_new_epoch_no_node_is_answered_from_and_every_node_is_told_to_resync(seq, t0):
    """``_rebase`` (the directory's history was lost): whatever state the log had reached (nodes live, syncing
    mid-inventory, dead), no placement is listed any more, and every node not dead that heartbeats or sends
    events, at any sequence number, is answered ``resync`` until its next full inventory."""
    entries = [entry_for(a, t0 + i) for i, a in enumerate(seq)]
    state = fresh(0.0)
    apply_all(state, entries + [commands.entry(commands.REBASE, {"epoch": "new", "why": "test"}, None,
                                               t0 + len(entries), "origin", 0)])
    assert view(state)["placements"] == {}
    assert not state.live_mask().any()
    for node in list(state.registry.nodes.values()):
        if node.state == "dead":
            continue
        for op, body in ((wire.HEARTBEAT, {"seq": 3, "used": {}, "bw": {}, "path_bw": {}}),
                         (wire.EVENTS, {"seq": 4, "events": []})):
            e = commands.entry(op, {"node": node.node_id, "incarnation": node.incarnation, **body}, None, t0, "o", 0)
            assert commands.apply(state, e)["resync"] is True
