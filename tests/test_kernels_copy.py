"""Gather/scatter of packed blocks: every engine layout, every backend that can run here, against a reference
built with plain torch indexing (tests/kv_engines.py).

Backends: cpu and torch always; triton in its interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before triton is imported) when triton is installed; cuda, triton and torch on a GPU when torch sees one.
"""

from __future__ import annotations

import importlib.util
import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import kv_engines  # noqa: E402

from kvtier import kernels  # noqa: E402
from kvtier.memory import hostcopy  # noqa: E402
from kvtier.blocks import block_rows  # noqa: E402
from kvtier.kernels import dispatch  # noqa: E402
from kvtier.layout import BlockLayout, CacheGroup  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
NO_TRITON = "triton is not installed (tests/run.sh installs it where it can)"
NO_GPU = "no CUDA GPU here (bench/gpu_check.sh runs these on a GPU machine)"


def _cases() -> list[object]:
    cases = [pytest.param("cpu", "cpu", id="cpu"), pytest.param("cpu", "torch", id="torch")]
    cases.append(pytest.param("cpu", "triton", id="triton-interp",
                              marks=pytest.mark.skipif(not HAVE_TRITON or CUDA, reason=NO_TRITON if not HAVE_TRITON
                                                       else "a GPU is here: triton runs compiled below")))
    for be in ("cuda", "triton", "torch"):
        reason = NO_GPU if not CUDA else NO_TRITON
        cases.append(pytest.param("cuda", be, id=f"gpu-{be}",
                                  marks=pytest.mark.skipif(not CUDA or (be == "triton" and not HAVE_TRITON),
                                                           reason=reason)))
    return cases


BACKENDS = _cases()


def _filled_packed(engine: kv_engines.Engine, n: int, device: str) -> torch.Tensor:
    return torch.full((n, engine.layout.nbytes), 0xA5, dtype=torch.uint8, device=device)


# Every engine layout into split k/v parts and into a fused kv part (MLA: its one latent part).
ENGINE_CASES = [pytest.param(name, fused, id=f"{name}-{'kv' if fused else 'k-v'}")
                for name in sorted(kv_engines.ENGINES) for fused in (False, True) if not (fused and "mla" in name)]


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("name,fused", ENGINE_CASES)
def test_gather_matches_reference_and_scatter_restores(name, fused, device, backend):
    engine = kv_engines.make(name, fused=fused, device=device, seed=zlib.crc32(f"{name}{fused}".encode()) & 0xFFFF)
    kv = engine.kv()
    ids = [4, 0, 4, 5, 2]  # any order, with a repeat
    packed = _filled_packed(engine, len(ids), device)
    assert kernels.gather(kv, ids, packed, backend=backend) == backend
    _sync(device)
    assert torch.equal(packed.cpu(), kv_engines.reference(engine, ids))

    # Scatter into a blank copy of the engine: exactly the gathered blocks come back, nothing else changes.
    before = [m.clone() for m in engine.memory]
    for m in engine.memory:
        m.zero_()
    distinct, rows = [4, 0, 5, 2], packed[[0, 1, 3, 4]]
    kernels.scatter(kv, distinct, rows, backend=backend)
    _sync(device)
    now = kv_engines.reference(engine, list(range(engine.num_blocks)))
    for b in range(engine.num_blocks):
        if b in distinct:
            assert torch.equal(now[b], rows[distinct.index(b)].cpu()), f"block {b} did not come back"
        else:
            assert not now[b].any(), f"block {b} was not scattered to but changed"
    # No byte outside the scattered blocks' fragments was written (padding, other blocks, pool tails).
    for m, orig in zip(engine.memory, before):
        changed = m != 0
        assert torch.equal(m[changed], orig[changed])


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_hybrid_groups_with_separate_block_tables_and_skips(device, backend):
    """Full attention (vLLM 0.33 pages) + sliding window (FlashInfer) + recurrent state (hand-made source):
    three block tables; SKIP where a group has no block (sliding window out of range)."""
    gen = torch.Generator().manual_seed(7)
    full = kv_engines.make_vllm(2, 2, 8, 4, "bfloat16", 5, fused=True, gen=gen, device=device)
    swa = kv_engines.make_flashinfer(1, 1, 16, 4, "bfloat16", 3, fused=False, gen=gen, device=device)
    state = kv_engines._typed(kv_engines.random_bytes(4 * 3 * 5 * 4, gen, device), "float32").view(4, 3, 5)
    layout = BlockLayout.hybrid(4, [
        CacheGroup("full", "attention", 2, full.layout.groups[0].parts, "bfloat16"),
        CacheGroup("swa", "sliding_window", 1, swa.layout.groups[0].parts, "bfloat16"),
        CacheGroup("ssm", "recurrent", 1, (("state", (3, 5)),), "float32"),
    ])
    sources = [*kernels.vllm_sources(layout, full.tensors, group="full"),
               *kernels.flashinfer_sources(layout, swa.tensors, group="swa"),
               kernels.KVSource(layout.region("ssm", 0, "state"), state)]
    kv = kernels.EngineKV(layout, sources)
    assert kv.num_blocks == {"full": 5, "swa": 3, "ssm": 4}
    ids = {"full": [3, 1, 0], "swa": [kernels.SKIP, 2, 0], "ssm": [kernels.SKIP, kernels.SKIP, 3]}
    packed = torch.full((3, layout.nbytes), 0xFF, dtype=torch.uint8, device=device)
    kernels.gather(kv, ids, packed, backend=backend)
    _sync(device)
    packed = packed.cpu()
    for i in range(3):
        for layer, data in enumerate(full.block(ids["full"][i])):
            got = layout.view(packed[i], layout.region("full", layer, "kv"))
            assert torch.equal(_bits(got), _bits(torch.cat([data["k"], data["v"]], -1)))
        swa_part = layout.view(packed[i], layout.region("swa", 0, "k"))
        if ids["swa"][i] == kernels.SKIP:
            assert not swa_part.view(torch.uint8).any(), "a skipped group must gather as zeros"
        else:
            assert torch.equal(_bits(swa_part), _bits(swa.block(ids["swa"][i])[0]["k"]))
        ssm = layout.view(packed[i], layout.region("ssm", 0, "state"))
        want = state[ids["ssm"][i]] if ids["ssm"][i] >= 0 else torch.zeros(3, 5)
        assert torch.equal(_bits(ssm), _bits(want))
    # Scatter with skips writes the groups that have a block and leaves the skipped ones' memory alone.
    state_before, swa_before = state.clone(), [m.clone() for m in swa.memory]
    kernels.scatter(kv, {"full": [0, 1, 2], "swa": [kernels.SKIP] * 3, "ssm": [kernels.SKIP, 0, kernels.SKIP]},
                    packed.to(device), backend=backend)
    _sync(device)
    for i in range(3):
        for layer, data in enumerate(full.block(i)):
            got = layout.view(packed[i], layout.region("full", layer, "kv"))
            assert torch.equal(_bits(got), _bits(torch.cat([data["k"], data["v"]], -1)))
    assert torch.equal(_bits(state[0]), _bits(layout.view(packed[1], layout.region("ssm", 0, "state"))))
    assert torch.equal(_bits(state[1:]), _bits(state_before[1:]))
    assert all(torch.equal(m, b) for m, b in zip(swa.memory, swa_before))


# ---- hypothesis: shapes, dtypes, id patterns ------------------------------------------------------------


@st.composite
def _configs(draw):
    name = draw(st.sampled_from(sorted(kv_engines.ENGINES)))
    mla = "mla" in name
    cfg = {
        "name": name,
        "layers": draw(st.integers(1, 3)),
        "heads": draw(st.integers(1, 3)),
        # odd head sizes give runs that are not 16-byte multiples: the kernels fall back to narrower vectors
        "head_dim": draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16, 64] if not mla else [4, 8, 12, 36])),
        "block_size": draw(st.sampled_from([2, 4, 6, 8] if name == "vllm-kernel-blocks" else [1, 2, 3, 4, 8])),
        "dtype": draw(st.sampled_from(sorted(kv_engines.DTYPES))),
        "num_blocks": draw(st.integers(1, 7)),
        "fused": draw(st.booleans()) and not mla,
        "seed": draw(st.integers(0, 2**16)),
    }
    n = cfg["num_blocks"]
    cfg["gather_ids"] = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=9))
    cfg["scatter_ids"] = draw(st.permutations(range(n)).map(lambda p: p[: draw(st.integers(0, n))]))
    return cfg


@pytest.mark.parametrize("device,backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_property_gather_is_reference_and_scatter_inverts_it(device, backend, cfg):
    cfg = dict(cfg)
    gather_ids, scatter_ids = cfg.pop("gather_ids"), cfg.pop("scatter_ids")
    engine = kv_engines.make(cfg.pop("name"), device=device, **cfg)
    kv = engine.kv()
    packed = torch.full((len(gather_ids), engine.layout.nbytes), 0x5A, dtype=torch.uint8, device=device)
    kernels.gather(kv, gather_ids, packed, backend=backend)
    _sync(device)
    assert torch.equal(packed.cpu(), kv_engines.reference(engine, gather_ids))

    # gather(ids) then scatter(ids) into a zeroed engine, then gather again: the identity.
    rows = kv_engines.reference(engine, list(scatter_ids)).to(device)
    for m in engine.memory:
        m.zero_()
    kernels.scatter(kv, list(scatter_ids), rows, backend=backend)
    again = torch.zeros_like(rows)
    kernels.gather(kv, list(scatter_ids), again, backend=backend)
    _sync(device)
    assert torch.equal(again, rows)


# ---- packed buffers: strided rows, BlockRows, staging, threads --------------------------------------------


def test_packed_rows_may_be_strided_and_block_rows():
    engine = kv_engines.make("vllm-LBNHC", fused=True)
    kv = engine.kv()
    ids = [1, 3, 2]
    want = kv_engines.reference(engine, ids)
    wide = torch.zeros(3, engine.layout.nbytes + 48, dtype=torch.uint8)  # e.g. slots with a header
    kernels.gather(kv, ids, wide[:, 16:16 + engine.layout.nbytes])
    assert torch.equal(wide[:, 16:16 + engine.layout.nbytes], want)
    assert not wide[:, :16].any() and not wide[:, 16 + engine.layout.nbytes:].any()
    # Host addresses (e.g. DRAM tier slots) as BlockRows.
    slots = [torch.zeros(engine.layout.nbytes, dtype=torch.uint8) for _ in ids]
    kernels.gather(kv, ids, block_rows(slots, 3, engine.layout.nbytes, writable=True))
    assert torch.equal(torch.stack(slots), want)


def test_staging_in_chunks(monkeypatch):
    """The staged path (scratch rows on the engine's device, copied per chunk) gives the same bytes."""
    engine = kv_engines.make("sglang", fused=True, num_blocks=7)
    kv = engine.kv()
    monkeypatch.setattr(dispatch, "STAGING_BYTES", 2 * engine.layout.nbytes)  # 2 blocks per chunk
    ids = [6, 0, 3, 3, 1]
    packed = torch.zeros(5, engine.layout.nbytes, dtype=torch.uint8)
    table = dispatch.block_id_table(kv, ids, scatter=False)
    rows = dispatch.packed_rows(packed, 5, engine.layout.nbytes, "packed")
    dispatch._staged(dispatch.backend("cpu"), kv, table, rows, False, 1)
    assert torch.equal(packed, kv_engines.reference(engine, ids))
    for m in engine.memory:
        m.zero_()
    distinct = [6, 0, 3, 1]
    dispatch._staged(dispatch.backend("cpu"), kv, dispatch.block_id_table(kv, distinct, True),
                     dispatch.packed_rows(packed[[0, 1, 2, 4]], 4, engine.layout.nbytes, "packed"), True, 1)
    again = torch.zeros(4, engine.layout.nbytes, dtype=torch.uint8)
    kernels.gather(kv, distinct, again)
    assert torch.equal(again, packed[[0, 1, 2, 4]])


@pytest.mark.parametrize("threads", [2, 3])
def test_cpu_threads(threads):
    engine = kv_engines.make("flashinfer-HND", layers=3, num_blocks=9)
    kv = engine.kv()
    ids = list(range(9))[::-1]
    packed = torch.zeros(9, engine.layout.nbytes, dtype=torch.uint8)
    kernels.gather(kv, ids, packed, backend="cpu", threads=threads)
    assert torch.equal(packed, kv_engines.reference(engine, ids))


def test_without_native_library_the_fallback_gives_the_same_bytes(monkeypatch):
    """hostcopy's fallback (numpy row tables + memmove, used where the C library was not built) agrees
    with the native loop, skips and padding included."""
    engine = kv_engines.make("vllm-BLHNC-shared", layers=3, heads=3, head_dim=3, fused=False)
    kv = engine.kv()
    assert kv.padding, "this shape must leave alignment padding between regions"
    ids = [2, kernels.SKIP, 5, 2]
    native = torch.full((4, engine.layout.nbytes), 7, dtype=torch.uint8)
    kernels.gather(kv, ids, native, backend="cpu")
    monkeypatch.setattr(hostcopy, "_lib", None)
    fallback = torch.full((4, engine.layout.nbytes), 7, dtype=torch.uint8)
    kernels.gather(kv, ids, fallback, backend="cpu")
    assert torch.equal(native, fallback)
    assert torch.equal(native, kv_engines.reference(engine, ids))
    for m in engine.memory:
        m.zero_()
    kernels.scatter(kv, [2, 5], fallback[[0, 2]], backend="cpu")
    assert torch.equal(kv_engines.reference(engine, [2, 5]), native[[0, 2]])


# ---- GPU: packed rows in host memory ----------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason=NO_GPU)
@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
@pytest.mark.parametrize("host", ["pinned", "pageable", "block-rows"])
@pytest.mark.parametrize("name", ["vllm-BLNHC-shared", "sglang", "mla"])
def test_gpu_kv_with_packed_rows_in_host_memory(name, host, backend, monkeypatch):
    """Device-to-host gathers and host-to-device scatters: the cuda kernel reads/writes pinned rows directly;
    everything else goes through staging on the device, here in chunks of 2 blocks."""
    if backend == "triton" and not HAVE_TRITON:
        pytest.skip(NO_TRITON)
    engine = kv_engines.make(name, fused=True, device="cuda", num_blocks=7, seed=3)
    kv = engine.kv()
    monkeypatch.setattr(dispatch, "STAGING_BYTES", 2 * engine.layout.nbytes)
    ids = [6, 0, 3, 3, 1]
    packed = torch.zeros(5, engine.layout.nbytes, dtype=torch.uint8, pin_memory=host != "pageable")
    target = block_rows(packed, 5, engine.layout.nbytes, writable=True) if host == "block-rows" else packed
    if host == "block-rows" and backend != "cuda":
        with pytest.raises(ValueError, match="cannot address host rows given as BlockRows"):
            kernels.gather(kv, ids, target, backend=backend)
        return
    kernels.gather(kv, ids, target, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(packed, kv_engines.reference(engine, ids))
    for m in engine.memory:
        m.zero_()
    distinct = [6, 0, 3, 1]
    rows = packed[[0, 1, 2, 4]].pin_memory() if host != "pageable" else packed[[0, 1, 2, 4]]
    kernels.scatter(kv, distinct, rows, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(kv_engines.reference(engine, distinct), rows)


@pytest.mark.skipif(not CUDA, reason=NO_GPU)
def test_gpu_auto_prefers_the_cuda_kernels():
    kv = kv_engines.make("sglang", device="cuda").kv()
    status = kernels.backend_status(kv)
    assert status["cuda"] is None, status["cuda"]
    assert kernels.pick_backend(kv).name == "cuda"


def test_auto_picks_cpu_for_host_kv():
    kv = kv_engines.make("mla").kv()
    assert kernels.pick_backend(kv).name == "cpu"
    status = kernels.backend_status(kv)
    assert status["cpu"] is None and status["torch"] is None and "not a GPU" in status["cuda"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare as bytes: random bit patterns include NaNs, which are never equal as floats."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
