"""Engine KV caches for the kernel tests, allocated the way each engine does, and a reference packer.

Each ``make_*`` returns an ``Engine``: the layout, the engine's tensors, the kvtier sources for them, and
``block(b)``: what engine block ``b`` holds per layer, read with plain torch indexing in the engine's own
terms (K and V as (tokens, heads, dim), or the MLA latent as (tokens, dim)). ``reference(engine, ids)``
packs those with ``BlockLayout.view``: an oracle that shares nothing with the fragment compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier import kernels
from kvtier.kernels import KVSource
from kvtier.layout import BlockLayout

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass
class Engine:
    layout: BlockLayout
    sources: list[KVSource]
    num_blocks: int
    block: Callable[[int], list[dict[str, torch.Tensor]]]  # block id -> per layer {"k","v"} or {"latent"}
    memory: list[torch.Tensor] = field(default_factory=list)  # every byte the engine owns, as uint8
    tensors: list[torch.Tensor] = field(default_factory=list)  # per-layer tensors as the engine hands them out

    def kv(self) -> kernels.EngineKV:
        return kernels.EngineKV(self.layout, self.sources)


def random_bytes(nbytes: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


def reference(engine: Engine, ids: list[int], group: str | None = None) -> torch.Tensor:
    """Packed rows for ``ids`` built from ``engine.block`` with plain indexing (zeros elsewhere)."""
    layout = engine.layout
    out = torch.zeros(len(ids), layout.nbytes, dtype=torch.uint8)
    g = layout.groups[0] if group is None else next(x for x in layout.groups if x.name == group)
    parts = [n for n, _ in g.parts]
    for i, b in enumerate(ids):
        if b < 0:
            continue
        for layer, data in enumerate(engine.block(b)):
            data = {k: v.cpu() for k, v in data.items()}
            if parts == ["kv"]:
                data = {"kv": torch.cat([data["k"], data["v"]], dim=-1)}
            for part in parts:
                region = layout.region(g.name, layer, part)
                layout.view(out[i], region).view(torch.uint8).copy_(data[part].contiguous().view(torch.uint8))
    return out


def _typed(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    return raw.view(DTYPES[dtype])


def make_vllm(layers: int, heads: int, head_dim: int, block_size: int, dtype: str, num_blocks: int, *,
              fused: bool, order: str = "LBNHC", pad: int = 0, gen: torch.Generator, device: str = "cpu",
              mla: bool = False) -> Engine:
    """vLLM 0.33: one raw byte buffer, per-layer logical (B, H, N, C) views laid out by ``order``
    (L-outer: each layer its own region; B-outer: all layers' pages of a block together, so the block
    stride exceeds the page), ``pad`` extra bytes after each block/layer run as vLLM's page padding."""
    es = DTYPES[dtype].itemsize
    heads, c = (1, head_dim) if mla else (heads, 2 * head_dim)
    page = heads * block_size * c * es
    if order.startswith("L"):
        layer_stride, block_stride = num_blocks * (page + pad), page + pad
    else:
        layer_stride, block_stride = page, layers * page + pad
    total = layers * num_blocks * (page + pad) + pad + 64
    raw = random_bytes(total, gen, device)
    typed = _typed(raw[: total // es * es], dtype)
    n_stride, h_stride = (heads * c, c) if order.endswith("NHC") else (c, block_size * c)
    views = [torch.as_strided(typed, (num_blocks, heads, block_size, c),
                              (block_stride // es, h_stride, n_stride, 1), (l * layer_stride) // es)
             for l in range(layers)]
    if mla:
        layout = BlockLayout.mla(layers, head_dim - head_dim // 4, head_dim // 4, dtype, block_size)
        block = lambda b: [{"latent": v[b, 0]} for v in views]  # noqa: E731
    else:
        layout = BlockLayout.mha(layers, heads, head_dim, dtype, block_size, kv_fused=fused)
        block = lambda b: [{"k": v[b].transpose(0, 1)[..., :head_dim],  # noqa: E731
                            "v": v[b].transpose(0, 1)[..., head_dim:]} for v in views]
    return Engine(layout, kernels.vllm_sources(layout, views), num_blocks, block, [raw], views)


def make_vllm_kernel_blocks(layers: int, heads: int, head_dim: int, block_size: int, dtype: str,
                            num_blocks: int, *, fused: bool, gen: torch.Generator, device: str = "cpu") -> Engine:
    """vLLM 0.33 with kernel blocks of half the manager block: (2B, H, N/2, C) views, NHC order."""
    half = block_size // 2
    raw = random_bytes(layers * 2 * num_blocks * heads * half * 2 * head_dim * DTYPES[dtype].itemsize, gen, device)
    nhc = _typed(raw, dtype).view(layers, 2 * num_blocks, half, heads, 2 * head_dim)
    views = [nhc[l].transpose(1, 2) for l in range(layers)]  # logical (2B, H, half, C)
    layout = BlockLayout.mha(layers, heads, head_dim, dtype, block_size, kv_fused=fused)

    def block(b: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for v in views:
            tokens = torch.cat([v[2 * b].transpose(0, 1), v[2 * b + 1].transpose(0, 1)])  # (N, H, C)
            out.append({"k": tokens[..., :head_dim], "v": tokens[..., head_dim:]})
        return out

    return Engine(layout, kernels.vllm_sources(layout, views), num_blocks, block, [raw], views)


def make_legacy(layers: int, heads: int, head_dim: int, block_size: int, dtype: str, num_blocks: int, *,
                fused: bool, gen: torch.Generator, device: str = "cpu") -> Engine:
    """vLLM < 0.33: per layer (2, B, N, H, D)."""
    shape = (2, num_blocks, block_size, heads, head_dim)
    tensors = [_typed(random_bytes(_nbytes(shape, dtype), gen, device), dtype).view(shape) for _ in range(layers)]
    layout = BlockLayout.mha(layers, heads, head_dim, dtype, block_size, kv_fused=fused)
    block = lambda b: [{"k": t[0, b], "v": t[1, b]} for t in tensors]  # noqa: E731
    return Engine(layout, kernels.vllm_legacy_sources(layout, tensors), num_blocks, block,
                  [t.view(torch.uint8) for t in tensors])


def make_flashinfer(layers: int, heads: int, head_dim: int, block_size: int, dtype: str, num_blocks: int, *,
                    fused: bool, gen: torch.Generator, device: str = "cpu", hnd: bool = False) -> Engine:
    """FlashInfer: per layer (B, 2, N, H, D), or (B, 2, H, N, D) for HND."""
    shape = (num_blocks, 2, heads, block_size, head_dim) if hnd else (num_blocks, 2, block_size, heads, head_dim)
    tensors = [_typed(random_bytes(_nbytes(shape, dtype), gen, device), dtype).view(shape) for _ in range(layers)]
    layout = BlockLayout.mha(layers, heads, head_dim, dtype, block_size, kv_fused=fused)
    if hnd:
        block = lambda b: [{"k": t[b, 0].transpose(0, 1), "v": t[b, 1].transpose(0, 1)} for t in tensors]  # noqa: E731
    else:
        block = lambda b: [{"k": t[b, 0], "v": t[b, 1]} for t in tensors]  # noqa: E731
    sources = kernels.flashinfer_sources(layout, tensors, kv_layout="HND" if hnd else "NHD")
    return Engine(layout, sources, num_blocks, block, [t.view(torch.uint8) for t in tensors], tensors)


def make_mla(layers: int, heads: int, head_dim: int, block_size: int, dtype: str, num_blocks: int, *,
             fused: bool, gen: torch.Generator, device: str = "cpu") -> Engine:
    """MLA before vLLM 0.33: per layer (B, N, kv_lora_rank + rope_dim); head_dim is the latent width."""
    shape = (num_blocks, block_size, head_dim)
    tensors = [_typed(random_bytes(_nbytes(shape, dtype), gen, device), dtype).view(shape) for _ in range(layers)]
    layout = BlockLayout.mla(layers, head_dim - head_dim // 4, head_dim // 4, dtype, block_size)
    block = lambda b: [{"latent": t[b]} for t in tensors]  # noqa: E731
    return Engine(layout, kernels.mla_sources(layout, tensors), num_blocks, block,
                  [t.view(torch.uint8) for t in tensors])


def make_sglang(layers: int, heads: int, head_dim: int, block_size: int, dtype: str, num_blocks: int, *,
                fused: bool, gen: torch.Generator, device: str = "cpu", mla: bool = False) -> Engine:
    """SGLang token pools: per layer k and v (T, H, D) (MLA: one (T, 1, C) pool); page b = tokens
    [b * P, (b + 1) * P). T is not a multiple of the page size: the tail is not addressable."""
    tokens = num_blocks * block_size + block_size // 2
    shape = (tokens, 1, head_dim) if mla else (tokens, heads, head_dim)

    def pool() -> torch.Tensor:
        return _typed(random_bytes(_nbytes(shape, dtype), gen, device), dtype).view(shape)

    page = lambda t, b: t[b * block_size:(b + 1) * block_size]  # noqa: E731
    if mla:
        pools = [pool() for _ in range(layers)]
        layout = BlockLayout.mla(layers, head_dim - head_dim // 4, head_dim // 4, dtype, block_size)
        return Engine(layout, kernels.sglang_mla_sources(layout, pools), num_blocks,
                      lambda b: [{"latent": page(t, b)[:, 0]} for t in pools], [t.view(torch.uint8) for t in pools])
    ks, vs = [pool() for _ in range(layers)], [pool() for _ in range(layers)]
    layout = BlockLayout.mha(layers, heads, head_dim, dtype, block_size, kv_fused=fused)
    return Engine(layout, kernels.sglang_sources(layout, ks, vs), num_blocks,
                  lambda b: [{"k": page(k, b), "v": page(v, b)} for k, v in zip(ks, vs)],
                  [t.view(torch.uint8) for t in ks + vs])


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n


# name -> (maker, extra keyword arguments): every layout the kernels support.
ENGINES: dict[str, tuple[Callable[..., Engine], dict[str, object]]] = {
    "vllm-LBNHC": (make_vllm, {"order": "LBNHC"}),
    "vllm-LBHNC": (make_vllm, {"order": "LBHNC"}),
    "vllm-BLNHC-shared": (make_vllm, {"order": "BLNHC", "pad": 32}),
    "vllm-BLHNC-shared": (make_vllm, {"order": "BLHNC", "pad": 16}),
    "vllm-mla": (make_vllm, {"order": "BLNHC", "mla": True}),
    "vllm-kernel-blocks": (make_vllm_kernel_blocks, {}),
    "vllm-legacy": (make_legacy, {}),
    "flashinfer-NHD": (make_flashinfer, {}),
    "flashinfer-HND": (make_flashinfer, {"hnd": True}),
    "mla": (make_mla, {}),
    "sglang": (make_sglang, {}),
    "sglang-mla": (make_sglang, {"mla": True}),
}


def make(name: str, *, layers: int = 2, heads: int = 2, head_dim: int = 8, block_size: int = 4,
         dtype: str = "bfloat16", num_blocks: int = 6, fused: bool = False, seed: int = 0,
         device: str = "cpu") -> Engine:
    maker, extra = ENGINES[name]
    gen = torch.Generator().manual_seed(seed)
    return maker(layers, heads, head_dim, block_size, dtype, num_blocks, fused=fused, gen=gen, device=device,
                 **extra)
