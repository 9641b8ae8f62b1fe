"""KVTierConnector on hybrid models, through vLLM's real hybrid KV cache manager (vllm_engine.Engine with
sliding-window and full-attention layers, or Mamba ("align" mode) and full-attention layers: vLLM plans them into
several KV cache groups): every group's
blocks saved and loaded, only the blocks a later hit can use stored, one lookup answer per request that
every group can restore, KV events per group, and the start-up refusals of what kvtier cannot store.

The fake forward writes KV that is a pure function of (rank, layer, position, token), and Engine.verify
checks every token inside each layer's window after every step: a block loaded from the wrong group, the
wrong position or not at all fails the step (the engine's blocks start as random garbage). A Mamba layer's
fake forward resumes from the state in the block ending where the step starts and fails unless it is the
state of exactly the tokens before it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.connectors.vllm import KVTierConnector  # noqa: E402
from kvtier.connectors.vllm.groups import (  # noqa: E402
    FULL,
    MAMBA,
    SLIDING_WINDOW,
    GroupSpec,
    UnsupportedCacheGroup,
    describe_groups,
    needed_blocks,
    restorable,
    save_mask,
)
from vllm_engine import (  # noqa: E402
    BLOCK,
    HEAD_SIZE,
    HEADS,
    MAMBA_STATE_BYTES,
    PREFIX,
    Engine,
    expected_state,
    make_request,
    vllm_config,
    worker_side,
)

WINDOW = 32  # tokens: a hit needs the 2 blocks before it (cdiv(31, 16))
TAIL = list(range(300, 300 + 3 * BLOCK))
PROMPT_A = PREFIX + TAIL + [5, 6, 7]  # 131 tokens: the engine's hit point is block boundary 8 (token 128)


def spec(window: int = 0) -> FullAttentionSpec | SlidingWindowSpec:
    kw = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def gemma_like() -> dict:
    """Gemma3's pattern: 3 sliding-window layers, then 1 full-attention layer (vLLM: 4 groups of 1 layer)."""
    return {f"model.layers.{i}.self_attn.attn": spec(0 if i == 3 else WINDOW) for i in range(4)}


def mamba_like() -> dict:
    """Qwen3-Next's pattern: 3 recurrent (GatedDeltaNet-like) layers, then 1 full-attention layer; the state page
    padded to the attention page, as vLLM plans such a model."""
    full = spec()
    state = MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.float16,), mamba_cache_mode="align",
                      page_size_padded=full.page_size_bytes)
    return {f"model.layers.{i}.attn": full if i == 3 else state for i in range(4)}


@pytest.fixture
def hybrid(model, ipc_dir):
    engines: list[Engine] = []

    def make(tp: int = 1, events: bool = False, specs: dict | None = None, **extra) -> Engine:
        config = vllm_config(model, {"dram_capacity": "4MiB", "staging_bytes": "64KiB", "ipc_dir": ipc_dir,
                                     **extra}, tp=tp, events=events)
        if specs is not None and any(isinstance(s, MambaSpec) for s in specs.values()):
            config.cache_config.mamba_cache_mode = "align"  # what vLLM picks for such a model with prefix caching
        eng = Engine(config, tp=tp, num_blocks=256, specs=specs or gemma_like())
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def stored_per_group(eng: Engine, req, rank: int = 0) -> list[int]:
    side = worker_side(eng, rank)
    return [sum(side.store.contains(ns.keys(req.block_hashes))) for ns in side.namespaces]


def run_prompt(eng: Engine, req_id: str, tokens: list[int]):
    req = make_request(req_id, tokens)
    eng.add(req)
    eng.run([req])
    return req


# ---- the connector is a hybrid one --------------------------------------------------------------------------


def test_connector_declares_hma_so_vllm_keeps_the_hybrid_manager(model, ipc_dir):
    config = vllm_config(model, {"ipc_dir": ipc_dir})
    assert issubclass(KVTierConnector, SupportsHMA)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)


def test_hybrid_engine_plans_several_groups_and_the_workers_keep_one_namespace_each(hybrid):
    eng = hybrid()
    groups = eng.scheduler.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec) for g in groups] == [SlidingWindowSpec] * 3 + [FullAttentionSpec]
    side = worker_side(eng)
    assert [g.kind for g in side.groups] == [SLIDING_WINDOW] * 3 + [FULL]
    digests = {ns.digest for ns in side.namespaces}
    assert len(digests) == 4  # one block hash, four different keys: a group never reads another's bytes


# ---- save and load every group --------------------------------------------------------------------------


def test_every_group_is_saved_and_loaded_bit_exact(hybrid):
    eng = hybrid()
    a = run_prompt(eng, "A", PROMPT_A)
    # Stored: the full-attention group up to the hit point (8 blocks), each sliding-window group only the
    # window before it (2 blocks), not the 6 blocks that fell out of every hit point's window.
    assert stored_per_group(eng, a) == [2, 2, 2, 8]
    assert eng.scheduler.reset_prefix_cache()
    before = eng.verified_tokens
    b = run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    assert eng.stats.data["load_blocks"] == 14 and not eng.stats.data.get("load_failed_blocks")
    assert b.num_computed_tokens >= 128 + 4  # the 128 tokens came from kvtier, then the rest was computed
    assert eng.verified_tokens > before and not eng.load_errors  # verify(): every token in its window exact


def test_a_hybrid_hit_reports_where_its_blocks_were(hybrid, tmp_path):
    """vLLM's per-source prefix-cache stats: the full-attention group's blocks DRAM dropped (the SSD still holds
    them) count as a disk hit, the rest as host; every group still loads bit-exact through staging."""
    eng = hybrid(ssd_path=str(tmp_path / "ssd"), ssd_capacity="64MiB", ssd_segment_bytes="1MiB",
                 ssd_offload="write_through", ssd_staging_bytes=0)
    a = run_prompt(eng, "A", PROMPT_A)
    side = worker_side(eng)
    full_keys = side.namespaces[3].keys(a.block_hashes[:8])
    assert side.store.flush(10) and side.store.tiers[1].contains(full_keys) == [True] * 8
    side.store.tiers[0].remove(full_keys[2:4])
    assert eng.scheduler.reset_prefix_cache()
    sources = []
    real = eng.connector.get_external_cache_hit_sources
    eng.connector.get_external_cache_hit_sources = lambda r, n: sources.append(real(r, n)) or sources[-1]
    run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    assert sources == [{CacheHitSource.HOST: 6 * BLOCK, CacheHitSource.DISK: 2 * BLOCK}]
    assert eng.stats.data["load_blocks"] == 14 and not eng.load_errors


def test_full_attention_alone_is_not_a_hit_when_a_window_is_missing(hybrid):
    """The fails-on-a-naive-lookup test: group 1's window block before the hit point is gone, so no boundary
    can be restored for every group; the full-attention group's 8 blocks alone must not be loaded."""
    eng = hybrid()
    a = run_prompt(eng, "A", PROMPT_A)
    side = worker_side(eng)
    assert side.store.remove(side.namespaces[1].keys(a.block_hashes[7:8])) == 1
    assert eng.scheduler.reset_prefix_cache()
    run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    assert not (eng.stats.data.get("load_blocks") or 0)
    assert not eng.load_errors  # a miss, computed by the engine: never a load with a hole


def test_tensor_parallel_ranks_each_store_their_share_of_every_group(hybrid):
    eng = hybrid(tp=2)
    a = run_prompt(eng, "A", PROMPT_A)
    assert stored_per_group(eng, a, 0) == stored_per_group(eng, a, 1) == [2, 2, 2, 8]
    assert worker_side(eng, 0).namespaces[3].digest != worker_side(eng, 1).namespaces[3].digest
    assert eng.scheduler.reset_prefix_cache()
    run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    assert eng.stats.data["load_blocks"] == 28 and not eng.load_errors  # both ranks' 14 blocks, verified


def test_kv_events_carry_each_blocks_group_and_kind(hybrid):
    eng = hybrid(events=True)
    run_prompt(eng, "A", PROMPT_A)
    stored = [e for e in eng.events if isinstance(e, BlockStored) and e.medium == "CPU"]  # not the GPU cache's
    by_group = {}
    for e in stored:
        by_group.setdefault(e.group_idx, []).extend(e.block_hashes)
        assert e.kv_cache_spec_kind == ("full_attention" if e.group_idx == 3 else "sliding_window")
        assert e.kv_cache_spec_sliding_window == (None if e.group_idx == 3 else WINDOW)
    assert {g: len(h) for g, h in by_group.items()} == {0: 2, 1: 2, 2: 2, 3: 8}


# ---- recurrent state (Mamba "align" mode) + full attention -------------------------------------------------------


def test_mamba_checkpoints_and_full_attention_are_saved_and_the_forward_resumes_from_the_right_state(hybrid):
    eng = hybrid(specs=mamba_like())
    assert [g.kind for g in worker_side(eng).groups] == [MAMBA] * 3 + [FULL]
    a = run_prompt(eng, "A", PROMPT_A)
    # One state per recurrent group, the one vLLM checkpointed at the hit point (block 8 ends at token 128); the
    # table's running states are not checkpoints and are not stored.
    assert stored_per_group(eng, a) == [1, 1, 1, 8]
    assert eng.scheduler.reset_prefix_cache()
    checked = eng.states_checked
    run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    assert eng.stats.data["load_blocks"] == 11 and not eng.load_errors
    assert eng.states_checked >= checked + 3  # B's forward resumed at token 128 from the loaded states


def test_kv_without_its_state_is_never_loaded(hybrid):
    eng = hybrid(specs=mamba_like())
    a = run_prompt(eng, "A", PROMPT_A)
    side = worker_side(eng)
    assert side.store.remove(side.namespaces[2].keys(a.block_hashes[7:8])) == 1
    assert eng.scheduler.reset_prefix_cache()
    run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    assert not (eng.stats.data.get("load_blocks") or 0) and not eng.load_errors


def test_negative_control_a_state_of_another_position_fails_the_resumed_forward(hybrid):
    """The harness's own check is live: kvtier's state object for group 0 replaced with the state after 112
    tokens (not 128) under the same key makes B's resumed forward fail; so the passing test above proves the
    right state was loaded, not merely some state."""
    eng = hybrid(specs=mamba_like())
    a = run_prompt(eng, "A", PROMPT_A)
    side = worker_side(eng)
    key = side.namespaces[0].keys(a.block_hashes[7:8])
    page = torch.zeros(1, side.store.block_bytes, dtype=torch.int8)
    page[0, :MAMBA_STATE_BYTES] = expected_state(0, 0, tuple(PROMPT_A[:112]))
    assert side.store.remove(key) == 1
    side.store.put(key, page.view(torch.uint8))
    assert eng.scheduler.reset_prefix_cache()
    with pytest.raises(AssertionError, match="not the state of its first 128 tokens"):
        run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])


# ---- what kvtier refuses at start-up ---------------------------------------------------------------------------


def _config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=list(groups))


def test_a_mamba_group_without_align_checkpoints_is_refused_at_start_up_naming_group_kind_and_what_to_do(
        model, ipc_dir):
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float16,))  # mamba_cache_mode "none"
    kv_config = _config(KVCacheGroupSpec(["l0"], mamba), KVCacheGroupSpec(["l1"], spec()))
    with pytest.raises(UnsupportedCacheGroup, match=r"group 0 of kind MambaSpec in mamba_cache_mode 'none'.*align"):
        KVConnectorFactory.create_connector(vllm_config(model, {"ipc_dir": ipc_dir}), KVConnectorRole.SCHEDULER,
                                            kv_config)


def test_a_draft_model_group_is_refused_by_name():
    kv_config = _config(KVCacheGroupSpec(["l0"], spec(WINDOW)), KVCacheGroupSpec(["d0"], spec(), is_eagle_group=True))
    with pytest.raises(UnsupportedCacheGroup, match=r"group 1 .*draft model"):
        describe_groups(kv_config)
    with pytest.raises(UnsupportedCacheGroup, match="speculative decoding"):
        describe_groups(_config(KVCacheGroupSpec(["l0"], spec(WINDOW)), KVCacheGroupSpec(["l1"], spec())),
                        speculative=True)


def test_a_single_group_model_keeps_its_keys():
    """Uniform models are stored as before: one full group, group 0, no kind in the namespace."""
    (group,) = describe_groups(_config(KVCacheGroupSpec(["l0", "l1"], spec())))
    assert (group.index, group.kind) == (0, FULL)


# ---- the rules, against brute force and the engine ---------------------------------------------------------


def _group(kind: str, window_blocks: int) -> GroupSpec:
    if kind in (FULL, MAMBA):
        return GroupSpec(0, kind, BLOCK, ())
    return GroupSpec(0, SLIDING_WINDOW, BLOCK, (), window=window_blocks * BLOCK + 1, spec=spec(window_blocks * BLOCK + 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([FULL, SLIDING_WINDOW, MAMBA]), st.integers(1, 4)), min_size=1, max_size=4),
       st.data())
def test_a_boundary_is_restorable_exactly_when_every_group_holds_what_it_needs(kinds, data):
    groups = [_group(k, w) for k, w in kinds]
    n = data.draw(st.integers(1, 24))
    present = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in groups]
    valid = restorable(groups, present)
    for k in range(n):
        brute = all(present[g][i] for g, group in enumerate(groups) for i in group.needed(0, k + 1))
        assert valid[k] == brute
    # What a worker pins covers every restorable boundary's needs, and holds only blocks it has.
    need = needed_blocks(groups, valid)
    for g, group in enumerate(groups):
        assert all(present[g][i] for i in need[g])
        for k in range(n):
            if valid[k]:
                assert set(group.needed(0, k + 1)) <= need[g]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 40), st.integers(1, 40), st.lists(st.integers(0, 40 * BLOCK), max_size=3))
def test_sliding_window_saves_are_the_engines_reachable_mask_and_cover_every_hit(window_blocks, start, count, points):
    group = _group(SLIDING_WINDOW, window_blocks)
    end = start + count
    mask = save_mask(group, start, end, points, hybrid=True)
    engine = SlidingWindowManager.reachable_block_mask(start, end, BLOCK, group.spec, False, 0, tuple(points))
    assert mask == (engine if engine is not None else [True] * count)
    for p in points:  # every block a hit at a hit point needs is stored
        b = p // BLOCK
        for i in group.needed(0, b):
            if start <= i < end:
                assert mask[i - start]


# ---- checkpoints reach the eviction policy ------------------------------------------------------------------


def _record_arrivals(side) -> list:
    """The arrivals the worker's store is told (its real observe still runs: the policy learns as always)."""
    seen: list = []
    observe = side.store.observe

    def recording(arrivals=(), completions=(), hints=()):
        seen.extend(arrivals)
        return observe(arrivals, completions, hints)

    side.store.observe = recording
    return seen


def test_a_requests_checkpoint_objects_reach_the_policy_as_its_checkpoints(hybrid):
    """The session-aware policy keeps a hybrid checkpoint's objects by agent (policies/checkpoints.py) only if
    it is told which keys they are: the arrival the worker's store gets names the checkpoint A's prefill makes
    (block 8, its prompt's end) with the three recurrent groups' states there, exactly the keys that were saved;
    B, resumed from it, names it too (what it restores from) beside its own."""
    eng = hybrid(specs=mamba_like())
    side = worker_side(eng)
    seen = _record_arrivals(side)
    a = run_prompt(eng, "A", PROMPT_A)
    states = [k for g in range(3) for k in side.namespaces[g].keys(a.block_hashes[7:8])]
    assert [(arr.request, [(b, list(keys)) for b, keys in arr.checkpoints]) for arr in seen] == [("A", [(8, states)])]
    assert all(side.store.contains(states))
    assert eng.scheduler.reset_prefix_cache()
    b = run_prompt(eng, "B", PREFIX + TAIL + [9, 9, 9, 9])
    boundaries = dict(seen[-1].checkpoints)
    assert seen[-1].request == "B" and boundaries[8] == states
    assert max(boundaries) == (len(b.prompt_token_ids) - 1) // BLOCK  # B's own: its prompt's end


def test_a_uniform_models_arrivals_name_no_checkpoints(model, ipc_dir):
    eng = Engine(vllm_config(model, {"dram_capacity": "4MiB", "staging_bytes": "64KiB", "ipc_dir": ipc_dir}),
                 num_blocks=256)
    try:
        seen = _record_arrivals(worker_side(eng))
        run_prompt(eng, "A", PROMPT_A)
        assert [arr.request for arr in seen] == ["A"] and seen[0].checkpoints == ()
    finally:
        eng.close()
