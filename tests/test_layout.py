import pytest
import torch

from kvtier.layout import BlockLayout, CacheGroup


def test_llama_block_size_matches_trace_readme():
    # 32 layers x 8 KV heads x 128 dim x 2 (K,V) x 2 bytes = 128 KiB per token; 8 MiB per 64-token block.
    layout = BlockLayout.for_model("llama-3.1-8b", block_size=64)
    assert layout.nbytes == 64 * 32 * 2 * 8 * 128 * 2 == 8 * 2**20
    assert layout.bytes_per_token == 128 * 1024


def test_mla_block_size():
    layout = BlockLayout.for_model("deepseek-v3", block_size=64)
    assert layout.nbytes == 61 * 64 * (512 + 64) * 2
    assert [r.part for r in layout.regions] == ["latent"] * 61


def test_regions_are_aligned_disjoint_and_cover_the_block():
    groups = [
        CacheGroup("full", "attention", 3, (("k", (16, 2, 8)), ("v", (16, 2, 8))), "float16"),
        CacheGroup("swa", "sliding_window", 2, (("kv", (16, 1, 6)),), "bfloat16"),  # 192 B: not 16-aligned?
        CacheGroup("ssm", "recurrent", 1, (("conv", (3, 5)), ("state", (7,))), "float32"),
    ]
    layout = BlockLayout.hybrid(16, groups)
    regions = sorted(layout.regions, key=lambda r: r.offset)
    assert len(regions) == 3 * 2 + 2 + 2
    end = 0
    for r in regions:
        assert r.offset % 16 == 0 and r.offset >= end
        end = r.offset + r.nbytes
    assert end <= layout.nbytes and layout.nbytes % 16 == 0 and layout.nbytes - end < 16


def test_fingerprint_is_stable_and_distinguishes_layouts():
    a = BlockLayout.mha(32, 8, 128, "bf16", 16)
    assert a.fingerprint == BlockLayout.mha(32, 8, 128, "bfloat16", 16).fingerprint
    # The value is part of every stored key: it must not change between releases (or processes).
    assert a.fingerprint == "ae7394ce3915be77"
    others = [BlockLayout.mha(32, 8, 128, "fp16", 16), BlockLayout.mha(32, 8, 128, "bf16", 32),
              BlockLayout.mha(32, 8, 128, "bf16", 16, kv_fused=True), BlockLayout.mha(31, 8, 128, "bf16", 16)]
    assert len({a.fingerprint, *(o.fingerprint for o in others)}) == 5


def test_view_roundtrip():
    layout = BlockLayout.mha(2, 2, 4, "float32", 4)
    block = torch.zeros(layout.nbytes, dtype=torch.uint8)
    r = layout.region("attention", 1, "v")
    layout.view(block, r).fill_(1.5)
    assert layout.view(block, r).shape == (4, 2, 4)
    assert (layout.view(block, layout.region("attention", 1, "k")) == 0).all()
    assert (block.view(torch.float32)[r.offset // 4 : (r.offset + r.nbytes) // 4] == 1.5).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "llama-9"}, "unknown model"),
])
def test_unknown_model(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockLayout.for_model(**kwargs)


def test_bad_groups():
    with pytest.raises(ValueError, match="unknown kind"):
        CacheGroup("x", "conv", 1, (("a", (1,)),))
    with pytest.raises(ValueError, match="unknown KV dtype"):
        BlockLayout.mha(1, 1, 1, "float64")
    with pytest.raises(ValueError, match="unique"):
        g = CacheGroup("x", "attention", 1, (("a", (1,)),))
        BlockLayout.hybrid(1, [g, g])


def test_fingerprint_same_in_another_process():
    import subprocess
    import sys

    code = "from kvtier.layout import BlockLayout; print(BlockLayout.for_model('qwen3-32b', 64).fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert out == BlockLayout.for_model("qwen3-32b", 64).fingerprint
