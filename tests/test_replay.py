"""The replayer: hits per tier worked out by hand, the subagent DAG and lanes on a virtual clock, and the
limits (OPT >= every policy, OPT <= infinite, unbounded capacity == infinite) on random traces."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tools.replay.replayer import HBM
from replaykit import BT, brute_force_opt, replay, req, sub, sweep, trace, workloads

# ---- hand-made trace, hits computed by hand ------------------------------------------------------------

HAND = [req([1, 2, 3], extra_tokens=32, out=20), req([1, 2, 3, 4], think=1.0, out=20), req([5, 6]),
        req([1, 2, 3, 4, 7]), req([1, 2, 3, 4, 7, 8])]


def test_hand_made_trace_hits_per_tier():
    """HBM 2 blocks, DRAM 3 blocks, LRU, write-through; keys reach both caches tail first (root most recent).

    r0 [1,2,3]: all computed; DRAM 3,2,1 (oldest first); HBM keeps 2,1 (3, the tail, is evicted).
    r1 [1,2,3,4]: HBM prefix 1,2; DRAM has 3; 4 computed and stored (evicts 2); HBM keeps 2,1 again.
    r2 [5,6]: all computed; DRAM evicts 1,3 for 6,5; HBM keeps 6,5.
    r3 [1,2,3,4,7]: nothing held in front; 5 computed, stored in batches DRAM can hold, tail first: 7 (4 is
                    held), then 3,2,1, which evict 4,5,7: DRAM keeps the root-most blocks; HBM keeps 2,1.
    r4 [1,2,3,4,7,8]: HBM prefix 1,2; DRAM has 3; 4 is gone, so 4,7,8 are computed.
    """
    run = replay(sweep([trace("hand", HAND)], prefill=64.0, decode=10.0, bandwidth=2048.0), "lru", 2, 3,
                 record=True)
    res = run.result
    assert [(r.hbm_blocks, r.store_blocks) for r in res.records] == [(0, 0), (2, 1), (0, 0), (0, 0), (2, 1)]
    inputs = 224 + 256 + 128 + 320 + 384
    assert res.input_tokens == inputs
    assert res.hit_tokens == {HBM: 4 * BT, "dram": 2 * BT}
    assert res.computed_tokens == inputs - 6 * BT
    assert res.hit_rate == pytest.approx(6 * BT / inputs)
    assert res.tier_hit_rate["dram"] == pytest.approx(2 * BT / inputs)
    block_bytes = 2048
    assert res.bytes_loaded == {"dram": 2 * block_bytes}
    assert res.bytes_stored == {"dram": (3 + 1 + 2 + 4 + 3) * block_bytes}
    # Timing: prefill 64 tok/s, decode 10 tok/s, DRAM loads one 2 KiB block per second.
    r0, r1 = res.records[0], res.records[1]
    assert (r0.arrival, r0.first_token, r0.done) == pytest.approx((0.0, 3.5, 5.5))  # 224 tokens, then 20 out
    assert (r1.arrival, r1.first_token, r1.done) == pytest.approx((6.5, 8.5, 10.5))  # think 1 s, load 1 s + 64 tok
    # The limits on this stream: infinite = accesses - distinct blocks; OPT = the brute-force optimum.
    stream = [1, 2, 3, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 1, 2, 3, 4, 7, 8]
    assert run.limits.infinite == len(stream) - 8
    assert run.limits.opt == brute_force_opt(stream, 5)
    assert res.hit_rate <= run.opt_hit_rate <= run.infinite_hit_rate


def test_hbm_only_and_write_back():
    hbm_only = replay(sweep([trace("hand", HAND)]), "lru", 2, 0).result
    assert hbm_only.hit_tokens == {HBM: 4 * BT}  # r1 and r4 reuse 1,2 from HBM; nothing below
    assert hbm_only.bytes_stored == {}
    # Write-back: DRAM gets what HBM evicts, in batches it can hold, the newest victims last (they stay).
    # r0: HBM evicts 3 -> DRAM 3. r1: HBM 1,2 + DRAM 3; HBM evicts 4,3 -> DRAM 3,4.
    # r2: HBM evicts 2,1 -> DRAM 4,2,1 (3 evicted). r3: DRAM has 1,2 (3 is gone); HBM evicts 6,5,7,4,3:
    # 6,5,7 go down, then 4,3 (evicting 6,5) -> DRAM 7,4,3. r4: HBM 1,2 + DRAM 3,4,7.
    back = replay(sweep([trace("hand", HAND)], offload="write-back"), "lru", 2, 3, record=True).result
    assert [(r.hbm_blocks, r.store_blocks) for r in back.records] == [(0, 0), (2, 1), (0, 0), (0, 2), (2, 3)]
    assert back.hit_tokens == {HBM: 4 * BT, "dram": 6 * BT}
    assert back.bytes_stored == {"dram": (1 + 1 + 2 + 5 + 1) * 2048}  # r4 stores only 8 (3,4,7 are held)


# ---- the subagent DAG and lanes ------------------------------------------------------------------------

def dag_trace():
    # r0 ends at 1 s of trace time; subagents A (spawned at 5 s: 20 - 15) and B (spawned at 4 s) run
    # together; the parent's r1 came 8 s after the last of them finished (t 30 - 22).
    a = sub([req([10, 11], out=10), req([10, 11, 12], think=2.0, out=10)], t=20.0, duration=15.0)
    b = sub([req([20, 21], out=10)], t=22.0, duration=18.0)
    return trace("dag", [req([1, 2], t=0.0, out=10), a, b, req([1, 2, 3], t=30.0, think=29.0, out=10)])


def test_parent_waits_for_its_subagents():
    res = replay(sweep([dag_trace()], decode=1.0), "lru", 8, 8, record=True).result
    root = [r for r in res.records if r.parent == -1]
    children = [r for r in res.records if r.parent != -1]
    assert [r.step for r in root] == [0, 2] and len(children) == 3  # A and B are one step
    r0, r1 = root
    assert all(c.arrival >= r0.done for c in children)
    assert sorted(c.arrival - r0.done for c in children if c.step == 0) == pytest.approx([3.0, 4.0])
    last_child_done = max(c.done for c in children)
    assert r1.arrival == pytest.approx(last_child_done + 8.0)  # not the recorded think_time of 29 s
    a1, b1 = sorted((c for c in children if c.step == 0), key=lambda c: -c.arrival)
    assert a1.arrival < b1.done and b1.arrival < a1.done  # the two subagents ran at the same time
    a2 = next(c for c in children if c.step == 1)
    assert a2.arrival == pytest.approx(a1.done + 2.0) and a2.hbm_blocks == 2  # its own prefix, in HBM


def test_lanes_take_the_next_trace_when_one_finishes():
    t1 = trace("one", [req([1, 2]), req([1, 2, 3], think=5.0)])
    t2 = trace("two", [req([1, 2]), req([1, 2, 3], think=5.0)])  # same ids: salts keep replays apart
    one_lane = replay(sweep([t1, t2], lanes=1, decode=10.0), "lru", 8, 8, record=True).result
    by_run = {}
    for r in one_lane.records:
        by_run.setdefault(r.run, []).append(r)
    first, second = sorted(by_run.values(), key=lambda rs: rs[0].arrival)
    assert second[0].arrival >= max(r.done for r in first)
    assert one_lane.hit_tokens[HBM] == 2 * 2 * BT  # each replay reuses only its own first request
    two_lanes = replay(sweep([t1, t2], lanes=2, decode=10.0), "lru", 8, 8, record=True).result
    assert sorted(r.arrival for r in two_lanes.records if r.step == 0) == [0.0, 0.0]


def test_think_time_is_capped():
    t = trace("slow", [req([1]), req([1, 2], think=1000.0)])
    res = replay(sweep([t], think_cap=60.0), "lru", 4, 4, record=True).result
    assert res.records[1].arrival - res.records[0].done == pytest.approx(60.0)


# ---- limits on random traces ---------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(traces=workloads(), hbm=st.integers(0, 4), dram=st.integers(1, 8), lanes=st.integers(1, 3),
       offload=st.sampled_from(["write-through", "write-back"]), prefill=st.sampled_from([1e9, 500.0]))
def test_opt_bounds_every_policy_and_unbounded_equals_infinite(traces, hbm, dram, lanes, offload, prefill):
    sw = sweep(traces, lanes=lanes, offload=offload, prefill=prefill, decode=100.0)
    for policy in ("lru", "s3fifo"):
        run = replay(sw, policy, hbm, dram)
        assert run.result.hit_rate <= run.opt_hit_rate + 1e-12
        assert run.opt_hit_rate <= run.infinite_hit_rate + 1e-12
        assert run.limits.opt <= run.limits.infinite
        unbounded = replay(sw, policy, hbm, sw.workload.unique_blocks)
        assert sum(unbounded.result.hit_tokens.values()) == unbounded.limits.infinite * BT
        assert unbounded.limits.opt == unbounded.limits.infinite


@settings(max_examples=10, deadline=None)
@given(traces=workloads(), hbm=st.integers(0, 3), dram=st.integers(1, 4), ssd=st.integers(1, 8))
def test_an_ssd_tier_slots_in_below_dram(tmp_path_factory, traces, hbm, dram, ssd):
    """The SSD tier (a real DiskTier on files) is one more tier name in the report; the limits hold with
    OPT at HBM + DRAM + SSD, and each run's SSD directory is fresh and removed afterwards."""
    root = tmp_path_factory.mktemp("ssd")
    sw = sweep(traces, lanes=2, extra={"ssd_path": str(root)})
    run = replay(sw, "lru", hbm, dram, ssd_capacity=ssd)
    assert set(run.result.tier_hit_rate) == {HBM, "dram", "ssd"}
    assert run.result.capacity_blocks == {HBM: hbm, "dram": dram, "ssd": ssd}
    assert run.result.hit_rate <= run.opt_hit_rate <= run.infinite_hit_rate
    unbounded = replay(sw, "lru", hbm, dram, ssd_capacity=max(1, sw.workload.unique_blocks))
    assert sum(unbounded.result.hit_tokens.values()) == unbounded.limits.infinite * BT
    assert list(root.iterdir()) == []


def test_ssd_hits_are_counted_per_tier(tmp_path):
    """DRAM 1 block, SSD 8: the second request finds its prefix on SSD (DRAM evicted it, on_evict demoted it)."""
    t = trace("ssd", [req([1, 2, 3]), req([9]), req([1, 2, 3, 4])])
    sw = sweep([t], extra={"ssd_path": str(tmp_path), "ssd_offload": "on_evict"})
    res = replay(sw, "lru", 0, 1, record=True, ssd_capacity=8).result
    assert [(r.hbm_blocks, r.store_blocks) for r in res.records] == [(0, 0), (0, 0), (0, 3)]
    assert res.hit_tokens["ssd"] + res.hit_tokens["dram"] == 3 * BT and res.hit_tokens["ssd"] >= 2 * BT
    assert res.bytes_loaded["ssd"] == res.hit_tokens["ssd"] // BT * 2048
