"""Hybrid models on a real vLLM engine through kvtier, with vLLM's hybrid KV cache manager ON (issue 24).

The tiny configs of tests/engine/hybrid/ (hybrid/README.md): a Gemma3 (3 sliding-window layers + 1 full) and a
Qwen3-Next (3 GatedDeltaNet layers + 1 full) with seeded random weights (kvtier.bench.tiny_llama --config; not
``load_format="dummy"``, whose greedy tokens are all the same). For each model, in order, sharing its engines
(an engine start costs 10-60 s on a loaded 2-core machine: three per model):

1. The engine without the connector runs with more than one KV cache group (the hybrid manager is on) and its
   greedy tokens vary: a wrong or missing state would show in them.
2. An engine with kvtier writes prefix P1's blocks under OTHER weights (seed 1) to kvtier's SSD (write_through),
   at the model path and under the stated checkpoint id the next engine uses (``weights_fingerprint``).
3. The model path gets the seed-0 weights; a new kvtier engine (still more than one group: the connector keeps the
   hybrid manager on) runs request A2, forgets its own prefix cache, and request B2 (A2's prefix, another tail)
   loads the prefix from kvtier (``num_cached_tokens``, vLLM's external-prefix-cache metrics) up to the deepest
   block boundary where every group can be restored, and B2's tokens and logprobs equal the engine's without
   the connector (threads pinned: bit-identical).
4. State of another position: a prompt that shares only part of A2's prefix, ending inside it where the engine
   kept no recurrent state (Qwen3-Next keeps a GatedDeltaNet checkpoint only at a prompt's last block boundary),
   is not served full-attention KV without its state: its outputs equal the engine's without the connector.
5. Negative control, state of another checkpoint: prefix P1's blocks (from step 2's weights) are found under the
   same stated checkpoint id and loaded (from the SSD), and the tokens differ from the engine's without the
   connector: the comparison of step 3 can fail, and the loaded groups' state really feeds the model.

And a cache kind kvtier cannot store (Qwen3-Next's state with vLLM's prefix caching off: no checkpoints) is an
error at start-up that names the group, its kind and what to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from .enginekit import HYBRID, Engines, Reference, assert_same, build_model, connector, prompt_tokens

from kvtier.bench.engine_proc import EngineError, EngineProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048  # the configs' max_position_embeddings
P1, P2 = prompt_tokens(1), prompt_tokens(2)  # 1,000 tokens each
A2, B2 = P2 + [5, 6, 7], P2 + [8, 9]
B = P1 + [8, 9]
# Shares A2's first 800 tokens (5 Qwen3-Next blocks of 160, 25 Gemma3 blocks of 32), then differs.
PART = P2[:800] + prompt_tokens(3, 60)

# The spec classes each model's groups must show (vLLM's v1/kv_cache_interface.py).
GROUP_KINDS = {"gemma3": {"SlidingWindowSpec", "FullAttentionSpec"}, "q3next": {"MambaSpec", "FullAttentionSpec"}}


@dataclass
class Hybrid:
    """One model's engines and paths, handed from test to test."""

    name: str
    engines: Engines
    model: Path  # the kvtier engines' model path: step 2's weights, then the reference's
    reference: Reference
    config: dict[str, Any]
    kv: list[EngineProcess] = field(default_factory=list)  # step 3's engine, used by 4 and 5


@pytest.fixture(scope="module", params=sorted(GROUP_KINDS))
def hy(request, engine_py: Path, work: Path) -> Iterator[Hybrid]:
    """Per model; pytest runs every test of one model before the next, and closes its engines in between."""
    name = request.param
    root = work / "hybrid" / name
    engines = Engines(engine_py, work / "logs")
    ref_model = build_model(engine_py, root / "ref-w0", seed=0, config=HYBRID / f"{name}.json")
    reference = Reference(engines.start(f"hybrid-{name}-reference", ref_model, max_model_len=MAX_MODEL_LEN))
    config = connector({"dram_capacity": "64MiB", "ssd_path": str(root / "ssd"), "ssd_capacity": "64MiB",
                        "ssd_offload": "write_through", "ipc_dir": str(root),
                        # a stated checkpoint id: step 2 and step 3 use other weights under it (the automatic
                        # fingerprint, which would keep them apart, is tested in test_engine_durability.py)
                        "weights_fingerprint": "checkpoint-1"})
    model = build_model(engine_py, root / "kv-model", seed=1, config=HYBRID / f"{name}.json")
    yield Hybrid(name, engines, model, reference, config)
    engines.close_all()


def groups(engine: EngineProcess) -> list[dict[str, Any]]:
    return engine.wait_ready()["kv_cache_groups"]


def boundary(engine: EngineProcess, prompt: list[int]) -> int:
    """The deepest block boundary a prefix hit on ``prompt`` can reach: vLLM computes at least the last prompt
    token, and hits are whole blocks (the engine's block size: 32, or 160 where Qwen3-Next's state raises it)."""
    block = engine.wait_ready()["block_size"]
    return (len(prompt) - 1) // block * block


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def test_hybrid_manager_on_and_tokens_vary(hy: Hybrid):
    kinds = [g["kind"] for g in groups(hy.reference.engine)]
    assert len(kinds) > 1 and set(kinds) == GROUP_KINDS[hy.name], kinds
    b, b2 = hy.reference(B), hy.reference(B2)
    assert len(set(b["tokens"])) > 1 and len(set(b2["tokens"])) > 1, (b["tokens"], b2["tokens"])
    assert b["tokens"] != b2["tokens"]


def test_state_of_other_weights_written(hy: Hybrid):
    writer = hy.engines.start(f"hybrid-{hy.name}-kv-w1", hy.model, hy.config, max_model_len=MAX_MODEL_LEN)
    info = writer.wait_ready()
    assert info["kv_connector"] == "KVTierConnector"
    assert [g["kind"] for g in info["kv_cache_groups"]] == [g["kind"] for g in groups(hy.reference.engine)]
    assert writer.generate([P1 + [5, 6, 7]])[0]["cached"] == 0
    assert writer.close() == 0  # write_through: P1's blocks are on the SSD


def test_prefix_from_kvtier_equals_engine_without_connector(hy: Hybrid, engine_py: Path):
    build_model(engine_py, hy.model, seed=0, config=HYBRID / f"{hy.name}.json")  # the reference's weights
    kv = hy.engines.start(f"hybrid-{hy.name}-kv-w0", hy.model, hy.config, max_model_len=MAX_MODEL_LEN)
    hy.kv.append(kv)
    assert len(groups(kv)) > 1  # the connector keeps vLLM's hybrid manager on
    assert groups(kv) == groups(hy.reference.engine)
    a2 = kv.generate([A2])[0]
    assert a2["cached"] == 0
    assert_same(a2, hy.reference(A2))  # the cold path through the connector (saves only) changes nothing
    assert kv.reset_prefix_cache()
    before = kv.metrics()
    b2 = kv.generate([B2])[0]
    after = kv.metrics()
    hit = boundary(kv, B2)
    assert b2["cached"] == hit > 0
    assert delta(before, after, "vllm:external_prefix_cache_hits") == hit
    assert delta(before, after, "vllm:prefix_cache_hits") == 0  # not from vLLM's own cache
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source{source=host}") == hit
    assert_same(b2, hy.reference(B2))


def test_state_of_another_position_never_served(hy: Hybrid):
    (kv,) = hy.kv
    assert kv.reset_prefix_cache()
    part = kv.generate([PART])[0]
    assert_same(part, hy.reference(PART))
    if hy.name == "q3next":
        # A2's GatedDeltaNet state exists at 960 only (its last block boundary): the full-attention blocks below
        # 800 are there, their state is not, so nothing is a hit.
        assert part["cached"] == 0


def test_negative_control_state_of_another_checkpoint_changes_tokens(hy: Hybrid):
    (kv,) = hy.kv
    assert kv.reset_prefix_cache()
    before = kv.metrics()
    b = kv.generate([B])[0]
    after = kv.metrics()
    hit = boundary(kv, B)
    assert b["cached"] == hit  # the other weights' state was loaded ...
    want = hy.reference(B)
    assert (b["tokens"], b["logprobs"]) != (want["tokens"], want["logprobs"])  # ... and shows in the outputs
    assert len(b["tokens"]) == len(want["tokens"])
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source{source=disk}") == hit  # from step 2's SSD


def test_unstorable_cache_kind_refused_at_start_up(engines: Engines, engine_py: Path, work: Path):
    """Qwen3-Next with vLLM's prefix caching off: its GatedDeltaNet groups keep no checkpoints (mamba_cache_mode
    "none"), so kvtier could only serve state from another position: the engine does not start, and the error
    names the group, its kind and what to do (never a silent start)."""
    model = build_model(engine_py, work / "hybrid" / "q3next-refused", seed=0, config=HYBRID / "q3next.json")
    root = work / "hybrid" / "refused"
    e = engines.start("hybrid-q3next-refused", model, connector({"dram_capacity": "16MiB", "ipc_dir": str(root)}),
                      max_model_len=MAX_MODEL_LEN, prefix_caching=False)
    with pytest.raises(EngineError) as refused:
        e.wait_ready()
    assert "kvtier cannot store KV cache group 0 of kind MambaSpec in mamba_cache_mode 'none'" in str(refused.value)
    assert "Enable prefix caching" in str(refused.value)
