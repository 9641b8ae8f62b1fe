"""The master's ops in-process, with injected clocks: the node protocol (register, inventory, events, gaps,
leases), cost plans, placement policies and hints. The daemon tests run the same ops over real sockets."""

import sys

import numpy as np

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.keys import Namespace
from kvtier.master import ops_node, ops_router
from kvtier.master.cost import CostDefaults
from kvtier.master.hints import HintTable
from kvtier.master.service import MasterSettings, MasterState
from kvtier.wire import WireError

KEYS = Namespace("state").keys(range(64))
BLOB = b"".join(KEYS)
MiB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def st_():
    clock = Clock()
    state = MasterState(MasterSettings(lease_s=1.0, cost=CostDefaults(tier_bw={"dram": 10e9, "ssd": 1e9},
                                                                       path_bw=2e9, rpc_latency_s=1e-3)),
                        mono=clock, wall=clock)
    state.clock = clock
    return state


def join(st, node, tiers=(("dram", 1 << 30), ("ssd", 1 << 34)), holdings=None, seq=0):
    r = ops_node.register(st, {"node": node, "incarnation": "i-" + node, "seq": seq,
                               "tiers": [list(t) for t in tiers]})
    assert r["resync"]
    ops_node.inventory(st, {"node": node, "incarnation": "i-" + node, "seq": seq, "part": 0, "last": True,
                            "tiers": holdings or {}, "block_bytes": {t[0]: MiB for t in tiers}})


def lookup(st, keys=KEYS):
    r = ops_router.lookup(st, {"keys": b"".join(keys)})
    return r["any"], {(n, t): c for n, t, c in r["prefix"]}


def test_inventory_events_and_lookup(st_):
    join(st_, "a", holdings={"dram": b"".join(KEYS[:10]), "ssd": b"".join(KEYS[:30])})
    join(st_, "b", holdings={"dram": b"".join(KEYS[:20])})
    assert lookup(st_) == (30, {("a", "dram"): 10, ("a", "ssd"): 30, ("b", "dram"): 20})
    r = ops_node.events(st_, {"node": "b", "incarnation": "i-b", "seq": 1,
                              "events": [[wire.ADD, "dram", b"".join(KEYS[20:40]), MiB],
                                         [wire.REMOVE, "dram", b"".join(KEYS[5:6]), 0]]})
    assert r == {"resync": False, "applied_seq": 1}
    assert lookup(st_) == (40, {("a", "dram"): 10, ("a", "ssd"): 30, ("b", "dram"): 5})
    # A repeat is ignored; a gap drops the node's placements at once and asks for an inventory.
    again = ops_node.events(st_, {"node": "b", "incarnation": "i-b", "seq": 1, "events": []})
    assert again["duplicate"]
    gap = ops_node.events(st_, {"node": "b", "incarnation": "i-b", "seq": 3, "events": []})
    assert gap["resync"]
    assert lookup(st_) == (30, {("a", "dram"): 10, ("a", "ssd"): 30})
    hb = ops_node.heartbeat(st_, {"node": "b", "incarnation": "i-b", "seq": 3})
    assert hb["resync"]


def test_bad_events_apply_nothing(st_):
    join(st_, "a", holdings={"dram": b"".join(KEYS[:5])})
    with pytest.raises(WireError, match="tier 'nvme' is not one node 'a' registered"):
        ops_node.events(st_, {"node": "a", "incarnation": "i-a", "seq": 1,
                              "events": [[wire.ADD, "dram", b"".join(KEYS[5:10]), MiB],
                                         [wire.ADD, "nvme", BLOB, MiB]]})
    assert lookup(st_)[0] == 5  # the good first event of the bad message was not applied
    assert ops_node.events(st_, {"node": "a", "incarnation": "i-a", "seq": 1, "events": []})["applied_seq"] == 1


def test_lease_expiry_drops_placements_at_once_and_unknown_node_must_reregister(st_):
    join(st_, "a", holdings={"dram": BLOB})
    join(st_, "b", holdings={"dram": b"".join(KEYS[:8])})
    st_.clock.t += 0.9
    ops_node.heartbeat(st_, {"node": "b", "incarnation": "i-b", "seq": 0})
    st_.clock.t += 0.2  # a: 1.1 s silent > 1.0 s lease; b: 0.2 s
    assert lookup(st_) == (8, {("b", "dram"): 8})
    with pytest.raises(WireError) as e:
        ops_node.heartbeat(st_, {"node": "a", "incarnation": "i-a", "seq": 0})
    assert e.value.code == wire.ERR_UNKNOWN_NODE
    # Re-registering starts a new sync generation; the old bits are swept, never answered.
    join(st_, "a", holdings={"ssd": b"".join(KEYS[:3])})
    assert lookup(st_) == (8, {("b", "dram"): 8, ("a", "ssd"): 3})
    assert st_.registry.location_count == 6  # a's first two locations are retired, not reused yet
    for _ in range(3):
        st_.tick()
    assert not st_.directory.sweeping
    # Swept locations are numbered again: a third generation of "a" reuses them instead of growing the masks.
    ops_node.inventory(st_, {"node": "a", "incarnation": "i-a", "seq": 0, "part": 0, "last": True,
                             "tiers": {"dram": b"".join(KEYS[:2])}, "block_bytes": {"dram": MiB}})
    assert st_.registry.location_count == 6
    assert lookup(st_) == (8, {("b", "dram"): 8, ("a", "dram"): 2})


def test_reregister_with_same_incarnation_and_seq_keeps_placements(st_):
    join(st_, "a", holdings={"dram": BLOB})
    r = ops_node.register(st_, {"node": "a", "incarnation": "i-a", "seq": 0, "tiers": [["dram", 1 << 30],
                                                                                      ["ssd", 1 << 34]]})
    assert not r["resync"] and lookup(st_)[0] == 64
    r = ops_node.register(st_, {"node": "a", "incarnation": "i-a", "seq": 7, "tiers": [["dram", 1 << 30],
                                                                                      ["ssd", 1 << 34]]})
    assert r["resync"] and lookup(st_)[0] == 0


def test_inventory_parts_out_of_order_are_rejected(st_):
    ops_node.register(st_, {"node": "a", "incarnation": "i-a", "seq": 0, "tiers": [["dram", 1 << 30]]})
    base = {"node": "a", "incarnation": "i-a", "seq": 0, "block_bytes": {"dram": MiB}}
    ops_node.inventory(st_, {**base, "part": 0, "last": False, "tiers": {"dram": b"".join(KEYS[:4])}})
    with pytest.raises(WireError, match="part 2 out of order"):
        ops_node.inventory(st_, {**base, "part": 2, "last": True, "tiers": {}})
    ops_node.inventory(st_, {**base, "part": 1, "last": True, "tiers": {"dram": b"".join(KEYS[4:6])}})
    assert lookup(st_) == (6, {("a", "dram"): 6})


def test_cost_prefers_local_dram_and_plans_a_cheapest_split(st_):
    join(st_, "a", holdings={"dram": b"".join(KEYS[:40])})
    join(st_, "b", holdings={"ssd": b"".join(KEYS[:60])})
    r = ops_router.cost(st_, {"keys": BLOB, "candidates": ["a", "b", "c"],
                              "model": {"block_tokens": 16, "prefill_tokens_per_s": 2000.0}})
    plans = {p["worker"]: p for p in r["plans"]}
    assert r["prefix_blocks"] == 60
    a, b, c = plans["a"], plans["b"], plans["c"]
    assert a["local_tokens"] == {"dram": 640} and a["remote_tokens"] == 320  # blocks 40..59 from b's ssd
    assert b["local_tokens"] == {"ssd": 960} and b["remote_tokens"] == 0
    # b holds all 60 on ssd (1 GB/s) but a's dram over the 2 GB/s path is faster for the first 40.
    assert b["plan"]["sources"] == {"a/dram": 40, "local/ssd": 20}
    assert c["local_tokens"] == {} and c["remote_tokens"] == 960
    # dram 10 GB/s local, ssd 1 GB/s, path 2 GB/s, 1 ms RPC: a = 40 MiB/10e9 + 20 MiB/1e9 + 1 ms.
    assert a["load_s"] == pytest.approx(40 * MiB / 10e9 + 20 * MiB / 1e9 + 1e-3)
    assert b["load_s"] == pytest.approx(40 * MiB / 2e9 + 1e-3 + 20 * MiB / 1e9)
    for p in plans.values():
        plan = p["plan"]
        assert plan["load_tokens"] + plan["recompute_tokens"] == 64 * 16
        assert plan["total_s"] <= p["load_s"] + 4 * 16 / 2000 + 1e-12  # no worse than loading all
        assert plan["total_s"] <= 64 * 16 / 2000 + 1e-12  # no worse than recomputing all
    assert a["plan"]["total_s"] < b["plan"]["total_s"]
    # c reads b's ssd over a 2 GB/s path: the ssd's 1 GB/s is the bottleneck either way, so b and c tie.
    assert c["plan"]["total_s"] == pytest.approx(b["plan"]["total_s"])
    # Measured signals replace the defaults: b measured 8 GB/s from a, a's dram reads at 6 GB/s, a's RPCs
    # take 3 ms.
    ops_node.heartbeat(st_, {"node": "b", "incarnation": "i-b", "seq": 0, "path_bw": {"a": 8e9}})
    ops_node.heartbeat(st_, {"node": "a", "incarnation": "i-a", "seq": 0, "bw": {"dram": 6e9},
                             "rpc_latency_s": 3e-3})
    r = ops_router.cost(st_, {"keys": BLOB, "candidates": ["b", "c"],
                              "model": {"block_tokens": 16, "prefill_tokens_per_s": 2000.0}})
    b2, c2 = r["plans"]
    assert b2["load_s"] == pytest.approx(40 * MiB / 6e9 + 3e-3 + 20 * MiB / 1e9)
    assert c2["load_s"] == pytest.approx(40 * MiB / 2e9 + 20 * MiB / 1e9 + 3e-3)


@given(held=st.lists(st.sampled_from(["a", "b", "ab", ""]), min_size=1, max_size=40),
       rate=st.floats(100, 1e6), bt=st.integers(1, 256))
@settings(max_examples=60, deadline=None)
def test_cost_plan_is_the_argmin_over_prefix_cuts(held, rate, bt):
    clock = Clock()
    st = MasterState(MasterSettings(lease_s=5.0), mono=clock, wall=clock)
    keys = KEYS[: len(held)]
    for node in "ab":
        join(st, node, holdings={"dram": b"".join(k for k, h in zip(keys, held) if node in h)})
    r = ops_router.cost(st, {"keys": b"".join(keys), "candidates": ["a", "b"],
                             "model": {"block_tokens": bt, "prefill_tokens_per_s": rate}})
    prefix = next((i for i, h in enumerate(held) if not h), len(held))
    assert r["prefix_blocks"] == prefix
    d = CostDefaults()
    local_s, remote_s = MiB / d.tier_bw["dram"], MiB / min(d.tier_bw["dram"], d.path_bw)
    for p in r["plans"]:
        me = p["worker"]
        assert p["local_tokens"] == ({"dram": sum(me in h for h in held[:prefix]) * bt}
                                     if any(me in h for h in held[:prefix]) else {})
        assert p["remote_tokens"] == sum(me not in h for h in held[:prefix]) * bt
        # Brute force over every cut: load the first m blocks (local if held here, else remote, plus one RPC
        # once a remote block is in), recompute the rest. The plan must be that minimum.
        best = min(sum(local_s if me in h else remote_s for h in held[:m])
                   + (d.rpc_latency_s if any(me not in h for h in held[:m]) else 0.0)
                   + (len(keys) - m) * bt / rate for m in range(prefix + 1))
        assert p["plan"]["total_s"] == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert p["plan"]["load_tokens"] + p["plan"]["recompute_tokens"] == len(keys) * bt


def test_route_put_policies(st_):
    join(st_, "a", tiers=(("dram", 10 * MiB),))
    join(st_, "b", tiers=(("dram", 100 * MiB), ("ssd", 100 * MiB)))
    hrw = ops_router.route_put(st_, {"sizes": [1] * 64, "keys": BLOB, "policy": "rendezvous"})
    again = ops_router.route_put(st_, {"sizes": [1] * 64, "keys": BLOB, "policy": "rendezvous"})
    assert hrw["targets"] == again["targets"] and {t[0] for t in hrw["targets"]} == {"a", "b"}
    most = ops_router.route_put(st_, {"sizes": [MiB] * 4})
    assert [t[0] for t in most["targets"]] == ["b"] * 4
    local = ops_router.route_put(st_, {"sizes": [MiB] * 12, "requester": "a", "policy": "local_first"})
    assert [t[0] for t in local["targets"]] == ["a"] * 9 + ["b"] * 3  # a's room (64 B went above), then spill
    with pytest.raises(WireError, match="needs the blocks' keys"):
        ops_router.route_put(st_, {"sizes": [1], "policy": "rendezvous"})
    with pytest.raises(WireError, match="unknown placement policy 'nope'"):
        ops_router.route_put(st_, {"sizes": [1], "policy": "nope"})
    # A client can name a registered policy, never make the daemon import a module.
    for spec in ("unittest.__main__:X", "kvtier.master.placement:MostAvailable", "os:system"):
        with pytest.raises(WireError, match="unknown placement policy"):
            ops_router.route_put(st_, {"sizes": [1], "policy": spec})
    assert "unittest.__main__" not in sys.modules
    # Everything is promised away: nothing more fits until a heartbeat reports real usage.
    full = ops_router.route_put(st_, {"sizes": [200 * MiB]})
    assert full["targets"] == [None] and full["placed"] == 0


def test_hints_expire_and_bump_the_version(st_):
    r = ops_router.pin(st_, {"keys": b"".join(KEYS[:3]), "ttl_s": 5.0})
    ops_router.pin(st_, {"session": "agent-7"})
    ops_router.priority(st_, {"keys": b"".join(KEYS[3:4]), "level": 3, "ttl_s": 1.0})
    h = ops_router.hints(st_, {})
    assert len(h["pins"]["expires"]) == 3 and h["session_pins"] == {"agent-7": 0.0}
    assert h["priority"]["levels"] == [3]
    assert ops_router.hints(st_, {"since": h["version"]}) == {"version": h["version"], "unchanged": True}
    st_.clock.t += 2.0
    h2 = ops_router.hints(st_, {"since": h["version"]})
    assert h2["version"] > h["version"] and h2["priority"]["levels"] == []
    ops_router.unpin(st_, {"keys": b"".join(KEYS[:3]), "session": "agent-7"})
    h3 = ops_router.hints(st_, {})
    assert h3["pins"]["keys"] == b"" and h3["session_pins"] == {} and r["count"] == 3


def test_hint_budget_counts_only_new_keys():
    h = HintTable(max_keys=10)
    h.pin(KEYS[:6], None, 60, now=0)
    h.pin(KEYS[:6], None, 60, now=1)  # re-pinning the same keys adds none
    h.pin(KEYS[2:8] + KEYS[2:4], None, 60, now=1)  # two new keys (repeats in a batch count once)
    with pytest.raises(WireError, match="exceed 10 keyed hints"):
        h.pin(KEYS[:11], None, 60, now=1)
    h.set_priority(KEYS[:2], None, level=2, ttl_s=60, now=1)
    h.set_priority(KEYS[:2], None, level=3, ttl_s=60, now=1)
    assert len(h.key_pins) == 8 and len(h.key_priority) == 2


class _NoWalk(dict):
    def items(self):
        raise AssertionError("expire() walked every hint")


def test_hint_expiry_walks_only_what_is_due():
    h = HintTable()
    h.pin(KEYS[:4], "s1", 10, now=0)
    h.pin(KEYS[:1], None, 50, now=0)  # extended: its first expiry is stale
    h.pin(KEYS[4:5], None, 0, now=0)  # never expires
    h.set_priority(KEYS[5:6], "s2", level=2, ttl_s=5, now=0)
    h.set_priority(KEYS[5:6], None, level=0, ttl_s=0, now=1)  # removed before it was due
    h.key_pins, h.key_priority = _NoWalk(h.key_pins), _NoWalk(h.key_priority)
    version = h.version
    assert not h.expire(4.0) and h.version == version  # nothing due: no walk, no new version
    assert h.expire(5.0) and h.session_priority == {} and h.version == version + 1
    assert h.expire(10.0) and set(h.key_pins) == {KEYS[0], KEYS[4]} and h.session_pins == {}
    h.key_pins, h.key_priority = dict(h.key_pins), dict(h.key_priority)
    restored = HintTable.from_wire(h.to_wire())  # the schedule is rebuilt from the tables
    assert restored.expire(50.0) and set(restored.key_pins) == {KEYS[4]}
    assert not restored.expire(1e12)


def test_wrong_types_name_the_field(st_):
    cases = [
        (ops_router.lookup, {"keys": "abc"}, "field 'keys': expected bin, got str"),
        (ops_router.lookup, {}, "field 'keys' is missing"),
        (ops_router.cost, {"keys": BLOB, "candidates": ["a"], "model": {"block_tokens": True}},
         "model: field 'block_tokens': expected int, got bool"),
        (ops_router.cost, {"keys": BLOB, "candidates": [1], "model": {}}, "field 'candidates'[0]"),
        (ops_router.top, {"n": 0}, "outside"),
        (ops_router.pin, {"ttl_s": 3}, "give 'keys' or 'session'"),
        (ops_node.register, {"node": "x", "incarnation": "y", "seq": 0, "tiers": [["dram", -1]]}, "tiers'[0]"),
    ]
    for op, body, msg in cases:
        with pytest.raises(WireError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            op(st_, body)


def test_oversized_batches_are_refused():
    state = MasterState(MasterSettings(max_batch_keys=8))
    with pytest.raises(WireError) as e:
        ops_router.lookup(state, {"keys": BLOB})
    assert e.value.code == wire.ERR_TOO_LARGE and "64 keys in one batch, the limit is 8" in e.value.message
    assert ops_router.lookup(state, {"keys": b"".join(KEYS[:8])})["n"] == 8


def test_lookup_updates_heat_and_top(st_):
    join(st_, "a", holdings={"dram": b"".join(KEYS[:10])})
    for _ in range(3):
        ops_router.lookup(st_, {"keys": b"".join(KEYS[:4])})
    ops_router.lookup(st_, {"keys": b"".join(KEYS[:4]), "touch": False})
    h = ops_router.heat(st_, {"keys": b"".join(KEYS[:5])})
    assert h["count"] == [3, 3, 3, 3, 0]
    top = ops_router.top(st_, {"n": 4})
    assert set(wire.unpack_keys(top["keys"])) == set(KEYS[:4]) and top["count"] == [3] * 4
    np.testing.assert_allclose(top["heat"], [3.0] * 4, rtol=1e-3)
