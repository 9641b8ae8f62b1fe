"""Hybrid models in the replay: the hit rule (the deepest boundary every cache group can be restored at), the
checkpoint rule, hits and bytes per group worked out by hand on a real store, and OPT bounding them."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.keys import Namespace
from kvtier.policies import Arrival
from kvtier.tools.replay.hbm import HbmPrefixCache
from kvtier.tools.replay.hybrid import STATE, HYBRID_MODELS, HybridModel, WindowGroup, checkpoints, restorable_depth
from kvtier.tools.replay.hybrid_replay import HybridCache
from kvtier.tools.replay.replayer import HBM, ReplayResult
from kvtier.tools.replay.sizing import model_layout
from kvtier.tools.replay.sweep import SIM_BLOCK_BYTES, build_store
from replaykit import BT, replay, req, sub, sweep, trace, workloads

# Full history 32 B/token: a 2 KiB block, one store slot. The state is two slots; a window block is one.
RECURRENT = HybridModel("tiny-recurrent", full_bytes_per_token=32, state_bytes=4096)
WINDOW = HybridModel("tiny-window", full_bytes_per_token=32, windows=(WindowGroup("sw", 32, 2 * BT + 1),))
BOTH = HybridModel("tiny-both", full_bytes_per_token=32, windows=(WindowGroup("sw", 32, BT + 1),), state_bytes=4096)
F = 32 * BT


# ---- the hit rule --------------------------------------------------------------------------------------

def brute_force_depth(full_prefix, window_held, tails, state_held):
    """The definition, boundary by boundary: every full-history block before d, each window group's tail
    before d, the state at d."""
    best = 0
    for d in range(full_prefix + 1):
        ok = state_held is None or d == 0 or state_held[d]
        for held, t in zip(window_held, tails):
            ok = ok and all(held[i] for i in range(max(0, d - t), d))
        if ok:
            best = d
    return best


@st.composite
def presence(draw):
    n = draw(st.integers(0, 24))
    full_prefix = draw(st.integers(0, n))
    tails = draw(st.lists(st.integers(0, 5), max_size=3))
    window_held = [np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool) for _ in tails]
    state_held = None
    if draw(st.booleans()):
        state_held = np.array([True] + draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    return full_prefix, window_held, tails, state_held


def held_in(window_held, state_held):
    """The presence oracle of arrays: window group g's block i, the state at boundary d."""
    return lambda objs: all(state_held[i] if g == STATE else window_held[g][i] for g, i in objs)


@settings(max_examples=200, deadline=None)
@given(presence(), st.data())
def test_restorable_depth_is_the_deepest_boundary_every_group_allows(case, data):
    full_prefix, window_held, tails, state_held = case
    n = max((len(h) for h in window_held), default=full_prefix)
    n = len(state_held) - 1 if state_held is not None else n
    recurrent = state_held is not None
    states = state_held if recurrent else np.ones(n + 1, bool)
    d = restorable_depth(full_prefix, range(n + 1), tails, recurrent, held_in(window_held, states))
    assert d == brute_force_depth(full_prefix, window_held, tails, state_held)
    assert 0 <= d <= full_prefix  # never deeper than the full-history blocks allow
    # Only the candidates count: a boundary the engine never checkpointed is not a hit.
    cands = data.draw(st.sets(st.integers(0, n)))
    got = restorable_depth(full_prefix, cands, tails, recurrent, held_in(window_held, states))
    assert got == max([c for c in cands if brute_force_depth(min(c, full_prefix), window_held, tails, state_held)
                       == c] + [0])
    if recurrent and d:
        assert state_held[d]  # KV without its state is never a hit
        # Losing the state at d falls back to the deepest boundary before d that still has everything.
        lost = state_held.copy()
        lost[d] = False
        back = restorable_depth(full_prefix, range(n + 1), tails, True, held_in(window_held, lost))
        assert back < d and back == brute_force_depth(d - 1, window_held, tails, state_held)


@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(0, 40), restored=st.integers(0, 40), junction=st.integers(0, 40),
       interval=st.integers(0, 8))
def test_checkpoints_are_the_prompt_end_the_junction_and_the_interval(blocks, restored, junction, interval):
    restored = min(restored, blocks)
    junction = min(junction, blocks)
    got = checkpoints(blocks, restored, junction, interval)
    assert got == sorted(set(got)) and all(restored < c <= blocks for c in got)
    assert (blocks in got) == (blocks > restored)  # the end of the prompt, unless it was restored whole
    assert (junction in got) == (restored < junction)  # the fork junction, where this prefill passes it
    on_interval = {c for c in got if interval and c % interval == 0}
    assert on_interval >= {c for c in range(restored + 1, blocks) if interval and c % interval == 0}


# ---- hits and bytes on a real store, by hand ------------------------------------------------------------

FORK = [req([1, 2, 3]), req([1, 2, 3, 4]), req([1, 2, 5]), req([1, 2, 6])]


def test_a_hit_needs_the_state_checkpointed_at_its_boundary():
    """HBM 0, DRAM 64 slots (nothing is evicted), LRU.

    r0 [1,2,3]: computed; checkpoint at 3 (prompt end): F 1,2,3 and the state at 3 stored.
    r1 [1,2,3,4]: restores at 3 (its state is there); checkpoint at 4.
    r2 [1,2,5]: 1,2 are held but no state at 2: nothing restored (a uniform model hits 2); its prefill passes the
                fork junction at 2 (its second sighting) and checkpoints it, and its prompt end.
    r3 [1,2,6]: restores at the junction, 2.
    """
    res = replay(sweep([trace("fork", FORK)], hybrid=RECURRENT), "lru", 0, 64, record=True).result
    assert [(r.hbm_blocks, r.store_blocks) for r in res.records] == [(0, 0), (0, 3), (0, 0), (0, 2)]
    assert res.hit_tokens == {HBM: 0, "dram": 5 * BT}
    assert res.group_bytes_stored == {"full": 6 * F, "state": 5 * 4096}  # states at 3, 4, 2, 3 of r2, 3 of r3
    assert res.group_bytes_loaded == {"full": 5 * F, "state": 2 * 4096}
    assert res.whole_bytes_stored == 6 * (F + 4096)
    # Negative control: the same trace with a uniform model hits the shared 1,2 of r2 as well.
    uniform = replay(sweep([trace("fork", FORK)]), "lru", 0, 64).result
    assert uniform.hit_tokens["dram"] == 7 * BT


def test_a_hit_needs_the_window_tail_before_its_boundary():
    """Window 129 tokens: restoring at d needs the window blocks d-2, d-1. r0 stores its F blocks and the tail
    3,4 at its end; r1 restores at 4, loading 4 F blocks and 2 window blocks; its checkpoint at 5 adds window
    block 5 (4 is held)."""
    res = replay(sweep([trace("w", [req([1, 2, 3, 4]), req([1, 2, 3, 4, 5])])], hybrid=WINDOW), "lru", 0, 64,
                 record=True).result
    assert [r.store_blocks for r in res.records] == [0, 4]
    assert res.group_bytes_stored == {"full": 5 * F, "sw": 3 * F}
    assert res.group_bytes_loaded == {"full": 4 * F, "sw": 2 * F}
    assert res.whole_bytes_stored == 5 * 2 * F  # every block of both groups


def test_a_window_model_restores_where_stored_tails_make_a_window_whole():
    """Window 129 tokens (2 blocks). Checkpoints at 4 (tail 2,3) and 6 (tail 4,5): boundary 5 is no checkpoint,
    but its window (blocks 3,4) is whole, so r2 restores 5. With recurrent state as well it restores only at
    the checkpoint 4 (the state exists only there)."""
    reqs = [req([1, 2, 3, 4]), req([1, 2, 3, 4, 5, 6]), req([1, 2, 3, 4, 5, 9])]
    res = replay(sweep([trace("w", reqs)], hybrid=WINDOW), "lru", 0, 64, record=True).result
    assert [r.store_blocks for r in res.records] == [0, 4, 5]
    both = HybridModel("tiny-both-2", full_bytes_per_token=32, windows=WINDOW.windows, state_bytes=4096)
    res = replay(sweep([trace("w", reqs)], hybrid=both), "lru", 0, 64, record=True).result
    assert [r.store_blocks for r in res.records] == [0, 4, 4]


def test_a_missing_state_falls_back_to_the_previous_checkpoint():
    """A real store; the state at 4 is removed: the hit falls back to the junction's checkpoint at 2, and with
    the window block before 2 gone too, to nothing."""
    ns = Namespace("hybrid-test", "x")
    keys = ns.keys(list(range(1, 9)))
    gids = np.arange(8)
    result = ReplayResult(hit_tokens={HBM: 0, "dram": 0})
    with build_store("lru", {"dram_capacity": 256}, {}, SIM_BLOCK_BYTES) as store:
        cache = HybridCache(BOTH, BT, store, HbmPrefixCache(0), 16, {"dram": 1e12}, result)

        def serve(ids):
            chain = [keys[i] for i in ids]
            return cache.serve(chain, gids[ids], Arrival(str(ids), chain))

        assert serve([0, 1, 2, 3]) == (0, 0, pytest.approx(0.0))  # checkpoint at 4
        assert serve([0, 1, 4])[1] == 0  # 0,1 held, no checkpoint at 2: checkpoints the junction 2 and 3
        assert serve([0, 1, 2, 3, 5])[1] == 4
        store.remove(cache.boundary_keys([keys[i] for i in (0, 1, 2, 3)], 4)[:1])  # one slot of the state at 4
        assert serve([0, 1, 2, 3, 6])[1] == 2
        store.remove(cache.boundary_keys([keys[0], keys[1]], 2)[-1:])  # the window block before 2
        assert serve([0, 1, 7])[1] == 0


# ---- limits ------------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(traces=workloads(), hbm=st.integers(0, 6), dram=st.integers(1, 12), lanes=st.integers(1, 3),
       model=st.sampled_from([RECURRENT, WINDOW, BOTH]))
def test_opt_bounds_a_hybrid_model(traces, hbm, dram, lanes, model):
    """Every full-history block a hybrid hit restores is a hit of a cache holding those blocks in the same
    slots (the state and window tails only take room): OPT on the block stream bounds it."""
    sw = sweep(traces, lanes=lanes, decode=100.0, hybrid=model)
    for policy in ("lru", "default"):
        run = replay(sw, policy, hbm, dram)
        r = run.result
        assert r.hit_rate <= run.opt_hit_rate + 1e-12 <= run.infinite_hit_rate + 2e-12
        assert r.computed_tokens + sum(r.hit_tokens.values()) == r.input_tokens
        assert sum(r.group_bytes_stored.values()) <= r.whole_bytes_stored + 4096 * r.requests * 3


def test_subagents_restore_at_the_junction_they_fork_from():
    """Two subagents share the parent's first two blocks: the first one's prefill checkpoints the junction,
    the second restores at it."""
    t = trace("sub", [req([1, 2, 3]), sub([req([1, 2, 10])], t=0.0, duration=0.0),
                      sub([req([1, 2, 20])], t=0.0, duration=0.0)])
    res = replay(sweep([t], hybrid=RECURRENT), "lru", 0, 64, record=True).result
    assert sorted(r.store_blocks for r in res.records) == [0, 0, 2]


# ---- presets ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HYBRID_MODELS))
def test_presets_size_their_groups(name):
    sizing = model_layout(name, BT)
    m = sizing.hybrid
    assert m is not None and m.source
    groups = {g.name: g for g in sizing.layout.groups}
    assert groups["full"].layer_bytes == round(m.full_bytes_per_token * BT) == sizing.share_bytes
    assert sizing.layout.nbytes == (sizing.share_bytes + m.state_bytes
                                    + sum(round(g.bytes_per_token * BT) for g in m.windows))
    # Storing only what can be used costs a checkpoint's state and tails, far less than a whole block per block.
    assert m.checkpoint_bytes(BT) < 100 * sizing.layout.nbytes


def test_checkpoint_interval_is_a_multiple_of_the_block():
    assert model_layout("qwen3-next-80b-a3b", BT, checkpoint_interval=4 * BT).hybrid.interval_tokens == 4 * BT
    with pytest.raises(ValueError, match="multiple of the block size"):
        model_layout("qwen3-next-80b-a3b", BT, checkpoint_interval=100)
    with pytest.raises(ValueError, match="for a hybrid model"):
        model_layout("llama-3.1-8b", BT, checkpoint_interval=BT)


# ---- the command line ----------------------------------------------------------------------------------

def test_replay_cli_reports_a_hybrid_model_per_group(tmp_path, capsys):
    """One sample trace through `kvtier replay --model qwen3-next-80b-a3b`: the JSON has the bytes per group and
    against every group whole; `--store-groups whole` replays packed blocks, which store far more per token."""
    from kvtier.tools.cli import main

    sample = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc" / "trace_0427.json.gz"
    common = [str(sample), "--lanes", "1", "--hbm", "5%", "--dram", "25%", "--policy", "lru", "--no-progress",
              "--model", "qwen3-next-80b-a3b"]
    assert main(["replay", *common, "--json", str(tmp_path / "useful.json")]) == 0
    out = capsys.readouterr().out
    assert "storing only what can be used" in out and "whole/tok" in out
    rep = json.loads((tmp_path / "useful.json").read_text())
    assert rep["model"]["hybrid"]["state_bytes"] == HYBRID_MODELS["qwen3-next-80b-a3b"].state_bytes
    pol = rep["policies"]["lru"]
    hy = pol["hybrid"]
    assert set(hy["group_bytes_stored"]) == {"full", "state"} and hy["group_bytes_stored"]["state"] > 0
    assert 0 < hy["stored_vs_whole"] < 0.2  # a 37.7 MiB state per block, stored at checkpoints only
    assert 0 <= pol["hit_rate"] <= pol["opt_hit_rate"] <= pol["infinite_hit_rate"]
    assert main(["replay", *common, "--store-groups", "whole", "--json", str(tmp_path / "whole.json")]) == 0
    whole = json.loads((tmp_path / "whole.json").read_text())["policies"]["lru"]
    assert "hybrid" not in whole
    assert sum(whole["bytes_stored"].values()) > 5 * sum(hy["group_bytes_stored"].values())
