"""cost() for a hybrid model's prompt: a prefix is priced as what restoring it needs (the full-history blocks
before a restore point, plus that point's state checkpoint and window tail, at the bytes the directory
recorded), and a prefix whose state no live node holds is priced as recomputed."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.client import api
from kvtier.keys import Namespace
from kvtier.master import ops_node, ops_router
from kvtier.master.cost import CostDefaults
from kvtier.master.service import MasterSettings, MasterState
from kvtier.wire import WireError

MiB = 1 << 20
FULL = Namespace("hybrid-cost").keys(range(64))  # full-attention blocks, 1 MiB each
STATE = Namespace("hybrid-cost/state").keys(range(64))  # the recurrent state after block i, 8 MiB
WINDOW = Namespace("hybrid-cost/window").keys(range(64))  # the window group's block i, 2 MiB
DRAM, PATH, RPC = 10e9, 2e9, 1e-3


def state():
    clock = lambda: 1000.0  # noqa: E731
    return MasterState(MasterSettings(lease_s=5.0, cost=CostDefaults(tier_bw={"dram": DRAM}, path_bw=PATH,
                                                                     rpc_latency_s=RPC)), mono=clock, wall=clock)


def join(st, node, full=(), objects=()):
    """``node`` holds ``full`` blocks (1 MiB) and ``objects`` as (keys, bytes each) in its DRAM."""
    ops_node.register(st, {"node": node, "incarnation": "i-" + node, "seq": 0, "tiers": [["dram", 1 << 40]]})
    ops_node.inventory(st, {"node": node, "incarnation": "i-" + node, "seq": 0, "part": 0, "last": True,
                            "tiers": {"dram": b"".join(full)}, "block_bytes": {"dram": MiB}})
    events = [[wire.ADD, "dram", b"".join(keys), nbytes] for keys, nbytes in objects if keys]
    if events:
        ops_node.events(st, {"node": node, "incarnation": "i-" + node, "seq": 1, "events": events})


def restore_objects(d, tail=2):
    """What restoring at boundary d needs besides the full-attention blocks: the state at d, the window tail."""
    return [STATE[d - 1], *WINDOW[max(0, d - tail):d]]


def cost(st, n, checkpoints=None, candidates=("a", "b"), rate=2000.0, bt=16):
    call = api.cost(FULL[:n], list(candidates), bt, rate, checkpoints=checkpoints)
    return ops_router.cost(st, call.body)


def test_a_restore_point_costs_its_blocks_its_state_and_its_window():
    """a holds 40 full blocks, and the state and window tail at 20 only (at 40 the state is missing): the
    prefix is 20 blocks, and loading it costs 20 MiB + 8 MiB of state + 2 x 2 MiB of window, not 40 blocks."""
    st = state()
    join(st, "a", FULL[:40], [(STATE[19:20], 8 * MiB), (WINDOW[18:20] + WINDOW[38:40], 2 * MiB)])
    cps = [(20, restore_objects(20)), (40, restore_objects(40))]
    r = cost(st, 64, cps, candidates=["a"], rate=1.0)  # a slow prefill: loading wins
    (a,) = r["plans"]
    assert r["prefix_blocks"] == 20 and a["prefix_tokens"] == 20 * 16
    need = 20 * MiB + 8 * MiB + 2 * 2 * MiB
    assert a["plan"]["load_bytes"] == need and a["plan"]["load_tokens"] == 20 * 16
    assert a["load_s"] == pytest.approx(need / DRAM) and a["plan"]["load_s"] == pytest.approx(need / DRAM)
    assert a["plan"]["sources"] == {"local/dram": 20 + 3}  # 20 blocks and 3 objects
    # Negative control: priced as a uniform model, the same holdings load all 40 blocks.
    uniform = cost(st, 64, None, candidates=["a"], rate=1.0)
    assert uniform["prefix_blocks"] == 40 and uniform["plans"][0]["plan"]["load_bytes"] == 40 * MiB


def test_a_prefix_without_its_state_is_priced_as_recompute():
    st = state()
    join(st, "a", FULL[:40], [(WINDOW[38:40], 2 * MiB)])  # the window tail, but no state anywhere
    r = cost(st, 40, [(40, restore_objects(40))], candidates=["a"], rate=1.0)
    (a,) = r["plans"]
    assert r["prefix_blocks"] == 0
    assert a["plan"]["load_tokens"] == 0 and a["plan"]["load_bytes"] == 0
    assert a["plan"]["recompute_tokens"] == 40 * 16 and a["plan"]["total_s"] == pytest.approx(40 * 16 / 1.0)
    # The state arrives on b: now the prefix restores, a fetching the state from b (one RPC round).
    join(st, "b", (), [(STATE[39:40], 8 * MiB)])
    (a,) = cost(st, 40, [(40, restore_objects(40))], candidates=["a"], rate=1.0)["plans"]
    assert a["plan"]["load_tokens"] == 40 * 16
    assert a["plan"]["load_s"] == pytest.approx((40 + 4) * MiB / DRAM + 8 * MiB / PATH + RPC)


@given(full=st.lists(st.sampled_from(["a", "b", "ab", ""]), min_size=1, max_size=24),
       points=st.dictionaries(st.integers(1, 24), st.sampled_from(["a", "b", "ab", ""]), max_size=6),
       rate=st.floats(50, 1e6), bt=st.integers(1, 64))
@settings(max_examples=60, deadline=None)
def test_the_plan_is_the_argmin_over_restore_points(full, points, rate, bt):
    """Brute force: a cut is 0 or a restore point within the held full-history prefix whose state is held;
    its cost is its blocks and its state (local, or remote over the path plus one RPC), then recompute."""
    n = len(full)
    points = {d: h for d, h in points.items() if d <= n}
    st = state()
    for node in "ab":
        join(st, node, [k for k, h in zip(FULL, full) if node in h],
             [([STATE[d - 1] for d, h in points.items() if node in h], 4 * MiB)])
    cps = [(d, [STATE[d - 1]]) for d in sorted(points)]
    r = cost(st, n, cps, rate=rate, bt=bt)
    prefix = next((i for i, h in enumerate(full) if not h), n)
    cuts = [0] + [d for d, h in sorted(points.items()) if h and d <= prefix]
    assert r["prefix_blocks"] == cuts[-1]
    for p in r["plans"]:
        me = p["worker"]

        def load(m):
            remote = [me not in h for h in full[:m]] + ([me not in points[m]] if m else [])
            s = sum(MiB / (DRAM if me in h else min(DRAM, PATH)) for h in full[:m])
            s += 4 * MiB / (DRAM if me in points[m] else min(DRAM, PATH)) if m else 0.0
            return s + (RPC if any(remote) else 0.0)

        best = min(load(m) + (n - m) * bt / rate for m in cuts)
        assert p["plan"]["total_s"] == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert p["plan"]["load_tokens"] // bt in cuts


@pytest.mark.parametrize("checkpoints, message", [
    ({"at": [5, 3], "counts": [1, 1], "keys": b"".join(STATE[:2])}, "ascend"),
    ({"at": [3], "counts": [2], "keys": STATE[0]}, "add up to 2"),
    ({"at": [99], "counts": [1], "keys": STATE[0]}, "'at'"),
    ({"at": [3], "counts": [1], "keys": b"x" * 5}, "whole number"),
    ({"at": [True], "counts": [1], "keys": STATE[0]}, "'at'"),
    ({"at": list(range(1, 4098)), "counts": [1] * 4097, "keys": STATE[0]}, "the limit is 4096"),
])
def test_bad_checkpoints_are_refused_naming_the_field(checkpoints, message):
    st = state()
    join(st, "a", FULL[:8])
    body = {"keys": b"".join(FULL[:8]), "candidates": ["a"], "checkpoints": checkpoints,
            "model": {"block_tokens": 16, "prefill_tokens_per_s": 1e3}}
    with pytest.raises(WireError, match="checkpoints") as e:
        ops_router.cost(st, body)
    assert message in str(e.value)
