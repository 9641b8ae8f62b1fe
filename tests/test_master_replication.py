"""Replicas in the master (master/replication.py), in-process over a real MasterState and the real node ops:
``locate`` chooses among a key's holders by weighted rendezvous (stable per key, spread by measured
bandwidth, same on any master); with --replicate-heat a hot key held by one pool is handed to another pool as
a copy in its heartbeat reply, cold replicas are handed back as drops, and a replica's pool dying leaves
the other one named."""

from __future__ import annotations

from kvtier import wire
from kvtier.master import ops_node, ops_router
from kvtier.master.service import MasterSettings, MasterState

BB = 4096


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def state(**kw) -> tuple[MasterState, Clock]:
    clock = Clock()
    return MasterState(MasterSettings(lease_s=10.0, **kw), mono=clock, wall=clock), clock


def pool(st: MasterState, name: str, keys: list[bytes], bw: float = 1e9) -> None:
    ops_node.register(st, {"node": name, "incarnation": f"i-{name}", "seq": 0, "address": f"tcp://{name}:1",
                           "tiers": [["dram", 1 << 30]], "labels": {"role": "pool"}})
    ops_node.inventory(st, {"node": name, "incarnation": f"i-{name}", "seq": 0, "part": 0, "last": True,
                            "tiers": {"dram": wire.pack_keys(keys)}, "block_bytes": {"dram": BB}})
    beat(st, name, bw)


def beat(st: MasterState, name: str, bw: float = 1e9, seq: int = 0) -> dict:
    return ops_node.heartbeat(st, {"node": name, "incarnation": f"i-{name}", "seq": seq, "used": {"dram": 0},
                                   "bw": {"dram": bw}, "path_bw": {}, "rpc_latency_s": 0.0})


def located(st: MasterState, keys: list[bytes]) -> list[str | None]:
    r = ops_router.locate(st, {"keys": wire.pack_keys(keys)})
    return [r["holders"][w][0] if w >= 0 else None for w in r["where"]]


KEYS = [i.to_bytes(16, "little") for i in range(1, 2001)]


def test_locate_spreads_keys_over_replicas_by_bandwidth_and_keeps_each_keys_choice():
    st, _ = state()
    pool(st, "a", KEYS, bw=3e9)
    pool(st, "b", KEYS, bw=1e9)
    first = located(st, KEYS)
    share = first.count("a") / len(KEYS)
    assert 0.68 < share < 0.82, share  # 3:1 bandwidth -> ~75% of the keys from a
    assert located(st, KEYS) == first  # stable per key
    # Another master (other location numbers: b registered first) answers the same.
    other, _ = state()
    pool(other, "b", KEYS, bw=1e9)
    pool(other, "a", KEYS, bw=3e9)
    assert located(other, KEYS) == first
    # One holder only: that one, whatever its bandwidth.
    st2, _ = state()
    pool(st2, "a", KEYS[:10], bw=1.0)
    pool(st2, "b", KEYS[10:20])
    assert located(st2, KEYS[:20]) == ["a"] * 10 + ["b"] * 10


def test_a_hot_key_on_one_pool_is_copied_to_another_and_dropped_again_when_cold():
    st, clock = state(replicate_heat=3.0, replicate_interval_s=1.0, heat_half_life_s=10.0)
    hot, cold = KEYS[:5], KEYS[5:10]
    pool(st, "a", hot + cold)
    pool(st, "b", [])
    pool(st, "c", [])
    for _ in range(4):
        ops_router.lookup(st, {"keys": wire.pack_keys(hot)})
    st.tick()
    work = {n: st.replication.work_for(n) for n in "abc"}
    assert "replicate" not in work["a"]  # never asked of the pool that holds it
    copies = [(target, w["replicate"]) for target, w in work.items() if "replicate" in w]
    asked = [k for _, tasks in copies for src, addr, blob in tasks for k in wire.unpack_keys(blob)]
    assert sorted(asked) == sorted(hot)  # the hot ones, each once; the cold ones not
    assert all(src == "a" and addr == "tcp://a:1" for _, tasks in copies for src, addr, _ in tasks)
    # The work reaches a pool in its heartbeat reply.
    target = copies[0][0]
    clock.t += 0.5
    st.replication._copies[target] = [["a", "tcp://a:1", [hot[0]]]]
    assert wire.unpack_keys(beat(st, target)["replicate"][0][2]) == [hot[0]]
    # The copies land (the pools report them): two holders, both named by locate for some keys.
    for t, tasks in copies:
        ops_node.events(st, {"node": t, "incarnation": f"i-{t}", "seq": 1,
                             "events": [[wire.ADD, "dram", blob, BB] for _, _, blob in tasks]})
    seqs = {t: 1 for t, _ in copies}
    assert None not in located(st, hot)
    both = [k for k in hot if sum(k in wire.unpack_keys(b) for _, tasks in copies for _, _, b in tasks)]
    assert both == hot  # every hot key now has a second holder
    # The holder of the first copy dies (silent past its lease): the replica serves.
    for _ in range(2):
        clock.t += 6.0
        for n in "bc":
            beat(st, n, seq=seqs.get(n, 0))
    st.expire_leases()
    assert st.registry.nodes["a"].state == "dead"
    assert None not in located(st, hot) and "a" not in located(st, hot)
    # Heat falls below half the threshold: replicas are asked to go, from all but the first holder.
    st2, clock2 = state(replicate_heat=3.0, replicate_interval_s=1.0, heat_half_life_s=1.0)
    pool(st2, "a", hot)
    pool(st2, "b", hot)
    for _ in range(4):
        ops_router.lookup(st2, {"keys": wire.pack_keys(hot)})
    st2.tick()
    assert st2.replication.work_for("b") == {}  # hot: kept
    clock2.t += 5.0  # five half-lives later
    for n in "ab":
        beat(st2, n)
    st2.replication._next = 0.0
    st2.tick()
    assert st2.replication.work_for("a") == {}
    assert sorted(wire.unpack_keys(st2.replication.work_for("b")["drop"])) == sorted(hot)


def test_replication_is_off_by_default():
    st, _ = state()
    pool(st, "a", KEYS[:5])
    pool(st, "b", [])
    for _ in range(10):
        ops_router.lookup(st, {"keys": wire.pack_keys(KEYS[:5])})
    st.tick()
    assert st.replication is None and "replicate" not in beat(st, "b")
