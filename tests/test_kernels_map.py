"""EngineKV: what the fragment compiler makes of each layout, and the clear errors for bad maps and calls."""

from __future__ import annotations

import kv_engines
import numpy as np
import pytest
import torch

from kvtier import kernels
from kvtier.blocks import block_rows
from kvtier.memory.hostcopy import FRAGMENT_FIELDS
from kvtier.layout import BlockLayout

F = {name: i for i, name in enumerate(FRAGMENT_FIELDS)}


def test_vllm_033_pages_into_fused_kv_are_one_run_per_layer():
    """LBNHC pages hold a layer's block as (N, H, 2D): exactly the fused part, one contiguous run."""
    engine = kv_engines.make("vllm-LBNHC", layers=3, heads=8, head_dim=128, block_size=16, fused=True)
    kv = engine.kv()
    assert len(kv.fragments) == 3
    assert (kv.fragments[:, F["nruns"]] == 1).all()
    assert (kv.fragments[:, F["run_bytes"]] == 16 * 8 * 256 * 2).all()
    assert kv.align == 16 and not kv.padding


def test_vllm_033_pages_into_split_parts_are_strided_runs():
    engine = kv_engines.make("vllm-LBNHC", layers=2, heads=8, head_dim=128, block_size=16, fused=False)
    kv = engine.kv()
    assert len(kv.fragments) == 4  # k and v per layer
    assert (kv.fragments[:, F["nruns"]] == 16 * 8).all()
    assert (kv.fragments[:, F["run_bytes"]] == 256).all()
    assert (kv.fragments[:, F["engine_run_stride"]] == 512).all()  # K and V side by side in the engine
    assert (kv.fragments[:, F["packed_run_stride"]] == 256).all()


def test_layers_sharing_one_buffer_keep_their_block_stride():
    engine = kv_engines.make("vllm-BLNHC-shared", layers=4, heads=2, head_dim=16, block_size=4, fused=True)
    kv = engine.kv()
    page = 2 * 4 * 32 * 2
    assert (kv.fragments[:, F["block_stride"]] == 4 * page + 32).all()  # all layers' pages + padding
    bases = kv.fragments[:, F["engine_base"]]
    assert list(np.diff(bases)) == [page] * 3  # layer l's page sits l pages into the block


def test_old_layouts_into_fused_kv_interleave_k_and_v():
    engine = kv_engines.make("vllm-legacy", layers=1, heads=4, head_dim=64, block_size=16, fused=True)
    kv = engine.kv()
    assert len(kv.fragments) == 2  # K half and V half of the one kv part
    assert (kv.fragments[:, F["nruns"]] == 16 * 4).all()
    assert sorted(kv.fragments[:, F["packed_offset"]] % 256) == [0, 128]


def test_mla_is_one_run_per_layer():
    kv = kv_engines.make("mla", layers=5, head_dim=576, block_size=64).kv()
    assert len(kv.fragments) == 5 and (kv.fragments[:, F["run_bytes"]] == 64 * 576 * 2).all()


def test_describe_names_what_matters():
    text = kv_engines.make("sglang", fused=True).kv().describe()
    assert "fragments" in text and "engine blocks attention: 6" in text


# ---- bad maps ---------------------------------------------------------------------------------------------


def test_wrong_layer_count_and_rank():
    layout = BlockLayout.mha(2, 2, 8, "bf16", 4)
    with pytest.raises(ValueError, match="has 2 layers, got 1 tensors"):
        kernels.vllm_sources(layout, [torch.zeros(3, 2, 4, 16, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="expected a 4-D tensor"):
        kernels.vllm_sources(layout, [torch.zeros(3, 2, 4, 16, 1, dtype=torch.bfloat16)] * 2)


def test_dtype_mismatch_is_named():
    layout = BlockLayout.mha(1, 2, 8, "bf16", 4)
    with pytest.raises(ValueError, match="dtype float16 does not match the layout's bfloat16"):
        kernels.EngineKV(layout, kernels.flashinfer_sources(layout, [torch.zeros(3, 2, 4, 2, 8, dtype=torch.half)]))


def test_fp8_moves_as_bytes_but_not_as_the_wrong_fp8():
    layout = BlockLayout.mla(1, 8, 4, "fp8", 4)
    kernels.EngineKV(layout, kernels.mla_sources(layout, [torch.zeros(3, 4, 12, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match="float8_e5m2 does not match"):
        kernels.EngineKV(layout, kernels.mla_sources(layout, [torch.zeros(3, 4, 12, dtype=torch.float8_e5m2)]))


def test_heads_and_tokens_swapped_is_a_shape_error():
    layout = BlockLayout.mha(1, 2, 8, "bf16", 4)  # parts (4 tokens, 2 heads, 8)
    hnd = torch.zeros(3, 2, 2, 4, 8, dtype=torch.bfloat16)  # FlashInfer HND, declared NHD below
    with pytest.raises(ValueError, match=r"shape \(2, 4, 8\) per block does not match the region's \(4, 2, 8\)"):
        kernels.EngineKV(layout, kernels.flashinfer_sources(layout, [hnd], kv_layout="NHD"))
    kernels.EngineKV(layout, kernels.flashinfer_sources(layout, [hnd], kv_layout="HND"))


def test_uncovered_and_overlapping_regions():
    layout = BlockLayout.mha(2, 2, 8, "bf16", 4, kv_fused=True)
    sources = kernels.flashinfer_sources(layout, [torch.zeros(3, 2, 4, 2, 8, dtype=torch.bfloat16)] * 2)
    with pytest.raises(ValueError, match=r"no engine tensor for 1 layout region\(s\): \('attention', layer 1, 'kv'\)"):
        kernels.EngineKV(layout, sources[:2])
    k_half = sources[0]
    overlap = kernels.KVSource(k_half.region, k_half.view, (..., slice(0, 8)))
    with pytest.raises(ValueError, match="overlap"):
        kernels.EngineKV(layout, [*sources, overlap])
    with pytest.raises(ValueError, match="uncovered"):
        kernels.EngineKV(layout, [s for s in sources if s is not sources[1]] +
                         [kernels.KVSource(sources[1].region, sources[1].view[..., :4], (..., slice(8, 12)))])


def test_group_must_be_named_for_hybrid_layouts():
    from kvtier.layout import CacheGroup

    layout = BlockLayout.hybrid(4, [CacheGroup("a", "attention", 1, (("k", (4, 1, 2)), ("v", (4, 1, 2)))),
                                    CacheGroup("b", "sliding_window", 1, (("k", (4, 1, 2)), ("v", (4, 1, 2))))])
    t = [torch.zeros(2, 2, 4, 1, 2, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="pass group= to say which one"):
        kernels.vllm_legacy_sources(layout, t)
    with pytest.raises(ValueError, match="no cache group 'c'"):
        kernels.vllm_legacy_sources(layout, t, group="c")


def test_sglang_pool_smaller_than_a_page():
    layout = BlockLayout.mha(1, 1, 2, "bf16", 16)
    with pytest.raises(ValueError, match="no whole page of 16"):
        kernels.sglang_sources(layout, [torch.zeros(8, 1, 2, dtype=torch.bfloat16)],
                               [torch.zeros(8, 1, 2, dtype=torch.bfloat16)])


# ---- bad calls --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return kv_engines.make("vllm-LBNHC", fused=True, num_blocks=6)


@pytest.mark.parametrize("ids,match", [
    ([0, 6], r"block_ids\[1\] = 6 is out of range for cache group 'attention' \(engine blocks 0..5"),
    ([-2], r"block_ids\[0\] = -2 is out of range"),
    ([0.5], "block_ids must be integers"),
    ([[0], [1]], r"a 2-D table needs one row per cache group \(1\)"),
    ({"other": [0]}, r"unknown cache group\(s\) \['other'\]"),
])
def test_bad_block_ids(engine, ids, match):
    kv = engine.kv()
    packed = torch.zeros(len(ids) if not isinstance(ids, dict) else 1, engine.layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        kernels.gather(kv, ids, packed)


def test_scatter_into_one_engine_block_twice(engine):
    packed = torch.zeros(2, engine.layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="names an engine block twice"):
        kernels.scatter(engine.kv(), [3, 3], packed)
    kernels.gather(engine.kv(), [3, 3], packed)  # repeats are fine for a gather


def test_bad_packed_buffers(engine):
    kv, nbytes = engine.kv(), engine.layout.nbytes
    with pytest.raises(ValueError, match=rf"expected shape \(2, {nbytes}\)"):
        kernels.gather(kv, [0, 1], torch.zeros(2, nbytes - 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected a uint8 tensor, got torch.float16"):
        kernels.gather(kv, [0], torch.zeros(1, nbytes // 2, dtype=torch.half))
    with pytest.raises(ValueError, match="rows must not overlap"):
        kernels.gather(kv, [0, 1], torch.zeros(2 * nbytes, dtype=torch.uint8).as_strided((2, nbytes), (16, 1)))
    with pytest.raises(ValueError, match="1 block ids but 2 packed rows"):
        kernels.gather(kv, [0], block_rows(torch.zeros(2, nbytes, dtype=torch.uint8), 2, nbytes))
    with pytest.raises(TypeError, match="expected an"):
        kernels.gather(kv, [0], bytearray(nbytes))


def test_forced_backend_that_cannot_run_says_why(engine):
    packed = torch.zeros(1, engine.layout.nbytes, dtype=torch.uint8)
    with pytest.raises(kernels.BackendUnavailable, match="'cuda' cannot run here: the engine KV is on cpu"):
        kernels.gather(engine.kv(), [0], packed, backend="cuda")
    with pytest.raises(ValueError, match="unknown kernel backend 'nope'"):
        kernels.gather(engine.kv(), [0], packed, backend="nope")


def test_empty_batch_is_a_no_op(engine):
    assert kernels.gather(engine.kv(), [], torch.zeros(0, engine.layout.nbytes, dtype=torch.uint8)) == "cpu"
