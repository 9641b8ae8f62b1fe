"""KVSource builders for the engines' paged KV layouts (pass the result to ``EngineKV``).

Each builder takes one cache group's per-layer tensors, in layer order, exactly as the engine allocated them,
and returns the sources for that group's regions. A single-group model is ``EngineKV(layout, builder(...))``;
a hybrid model concatenates one builder call per cache group (``group=`` names it), plus hand-made
``KVSource`` views for state the builders do not know (e.g. Mamba conv/SSM state).

The group's parts decide what goes where: ``k`` and ``v`` parts (each (tokens, heads, head_dim)), one fused
``kv`` part (tokens, heads, k_dim + v_dim: K and V side by side per token and head, as vLLM >= 0.33 keeps
them), or one MLA ``latent`` part (tokens, kv_lora_rank + rope_dim). Any engine layout fills any of those:
the fragment compiler turns the difference into strided runs.

| builder                 | per-layer tensor(s)                                  | engine                          |
|-------------------------|------------------------------------------------------|---------------------------------|
| ``vllm_sources``        | (num_blocks, H, N, C) logical view, any stride order | vLLM >= 0.33 (also MLA: H == 1) |
| ``vllm_legacy_sources`` | (2, num_blocks, N, H, D)                             | vLLM < 0.33 flash-attn          |
| ``flashinfer_sources``  | (num_blocks, 2, N, H, D), or (.., 2, H, N, D) "HND"  | FlashInfer paged KV             |
| ``mla_sources``         | (num_blocks, N, kv_lora_rank + rope_dim)             | vLLM < 0.33 MLA                 |
| ``sglang_sources``      | k and v token pools, (num_tokens, H, D) each         | SGLang MHATokenToKVPool         |
| ``sglang_mla_sources``  | token pool (num_tokens, 1, kv_lora_rank + rope_dim)  | SGLang MLATokenToKVPool         |
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.kernels.enginekv import KVSource, region_of
from kvtier.layout import BlockLayout, CacheGroup


def vllm_sources(layout: BlockLayout, kv_caches: Sequence[torch.Tensor], group: str | None = None
                 ) -> list[KVSource]:
    """vLLM >= 0.33: each layer a logical (num_blocks, H, N, C) view of one int8 buffer (RFC #42082), K then V
    on the C axis (C = head_size + head_size_v), in whatever physical order the resolved ``KVCacheLayout``
    gives (LBNHC by default: (B, N, H, C); block-outer layouts let layers share a buffer, so the block
    stride exceeds the page). MLA layers have H == 1 and C = kv_lora_rank + rope_dim. Kernel-block
    splitting (N smaller than the layout's block_size) is handled: a manager block is N-token kernel
    blocks at consecutive indices."""
    g = _group(layout, group)
    sources = []
    for layer, t in enumerate(_layers(g, kv_caches, 4, "vllm", "(num_blocks, num_kv_heads, block_size, C)")):
        ratio = _kernel_blocks_per_block(layout, g, layer, int(t.shape[2]), int(t.shape[0]))
        # (B*ratio, H, Nk, C) -> (B, ratio, Nk, H, C): tokens outer, heads inner, as the packed parts are.
        tokens_first = t.unflatten(0, (-1, ratio)).permute(0, 1, 3, 2, 4)
        if _is_mla(g):
            if t.shape[1] != 1:
                raise ValueError(f"vllm group {g.name!r} layer {layer}: MLA caches have one head, got {t.shape[1]}")
            sources.append(KVSource(region_of(layout, g.name, layer, "latent"), tokens_first[:, :, :, 0]))
            continue
        k_dim = _k_dim(g)
        sources += _attention_sources(layout, g, layer, tokens_first[..., :k_dim], tokens_first[..., k_dim:],
                                      fused=tokens_first)
    return sources


def vllm_legacy_sources(layout: BlockLayout, kv_caches: Sequence[torch.Tensor], group: str | None = None
                        ) -> list[KVSource]:
    """vLLM before 0.33 (flash-attn backend): each layer (2, num_blocks, N, H, D), K at [0] and V at [1]."""
    g = _group(layout, group)
    sources = []
    for layer, t in enumerate(_layers(g, kv_caches, 5, "vllm legacy", "(2, num_blocks, block_size, H, D)")):
        _expect(t.shape[0] == 2, f"vllm legacy layer {layer}: dim 0 must be 2 (K, V), got {tuple(t.shape)}")
        sources += _attention_sources(layout, g, layer, t[0], t[1])
    return sources


def flashinfer_sources(layout: BlockLayout, kv_caches: Sequence[torch.Tensor], group: str | None = None,
                       kv_layout: str = "NHD") -> list[KVSource]:
    """FlashInfer paged KV: each layer (num_blocks, 2, N, H, D) with ``kv_layout="NHD"``, or
    (num_blocks, 2, H, N, D) with ``"HND"``."""
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"flashinfer kv_layout must be NHD or HND, got {kv_layout!r}")
    g = _group(layout, group)
    sources = []
    for layer, t in enumerate(_layers(g, kv_caches, 5, "flashinfer", f"(num_blocks, 2, ..) {kv_layout}")):
        _expect(t.shape[1] == 2, f"flashinfer layer {layer}: dim 1 must be 2 (K, V), got {tuple(t.shape)}")
        k, v = t[:, 0], t[:, 1]
        if kv_layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        sources += _attention_sources(layout, g, layer, k, v)
    return sources


def mla_sources(layout: BlockLayout, kv_caches: Sequence[torch.Tensor], group: str | None = None
                ) -> list[KVSource]:
    """MLA (DeepSeek) before vLLM 0.33: each layer (num_blocks, N, kv_lora_rank + rope_dim)."""
    g = _group(layout, group)
    _expect(_is_mla(g), f"group {g.name!r} has parts {[n for n, _ in g.parts]}, not one 'latent' part")
    return [KVSource(region_of(layout, g.name, layer, "latent"), t)
            for layer, t in enumerate(_layers(g, kv_caches, 3, "mla", "(num_blocks, block_size, C)"))]


def sglang_sources(layout: BlockLayout, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                   group: str | None = None) -> list[KVSource]:
    """SGLang MHA token pools: per layer a K and a V buffer of (num_tokens, H, D); page p (the engine block
    id) is tokens [p * page_size, (p + 1) * page_size), page_size = the layout's block_size."""
    g = _group(layout, group)
    ks = _layers(g, k_buffers, 3, "sglang k_buffer", "(num_tokens, H, D)")
    vs = _layers(g, v_buffers, 3, "sglang v_buffer", "(num_tokens, H, D)")
    sources = []
    for layer, (k, v) in enumerate(zip(ks, vs)):
        sources += _attention_sources(layout, g, layer, _pages(k, layout.block_size), _pages(v, layout.block_size))
    return sources


def sglang_mla_sources(layout: BlockLayout, kv_buffers: Sequence[torch.Tensor], group: str | None = None
                       ) -> list[KVSource]:
    """SGLang MLA token pool: per layer (num_tokens, 1, kv_lora_rank + rope_dim), pages as in sglang_sources."""
    g = _group(layout, group)
    _expect(_is_mla(g), f"group {g.name!r} has parts {[n for n, _ in g.parts]}, not one 'latent' part")
    return [KVSource(region_of(layout, g.name, layer, "latent"), _pages(t, layout.block_size)[:, :, 0])
            for layer, t in enumerate(_layers(g, kv_buffers, 3, "sglang kv_buffer", "(num_tokens, 1, C)"))]


# ---- shared helpers ------------------------------------------------------------------------------------


def _attention_sources(layout: BlockLayout, g: CacheGroup, layer: int, k: torch.Tensor, v: torch.Tensor,
                       fused: torch.Tensor | None = None) -> list[KVSource]:
    """K and V views (blocks, tokens.., heads, dim) into the group's k/v parts or its fused kv part."""
    parts = {name for name, _ in g.parts}
    if parts == {"k", "v"}:
        return [KVSource(region_of(layout, g.name, layer, "k"), k), KVSource(region_of(layout, g.name, layer, "v"), v)]
    if parts == {"kv"}:
        kv = region_of(layout, g.name, layer, "kv")
        if fused is not None:
            return [KVSource(kv, fused)]
        k_dim = int(k.shape[-1])
        return [KVSource(kv, k, (..., slice(0, k_dim))), KVSource(kv, v, (..., slice(k_dim, None)))]
    raise ValueError(f"group {g.name!r}: attention caches fill parts k and v, or kv; this group has "
                     f"{sorted(parts)} (map other parts with explicit KVSource views)")


def _group(layout: BlockLayout, name: str | None) -> CacheGroup:
    if name is None:
        if len(layout.groups) != 1:
            raise ValueError(f"the layout has cache groups {[g.name for g in layout.groups]}: pass group= to say "
                             "which one these tensors hold")
        return layout.groups[0]
    for g in layout.groups:
        if g.name == name:
            return g
    raise ValueError(f"no cache group {name!r} in the layout; groups: {[g.name for g in layout.groups]}")


def _layers(g: CacheGroup, tensors: Sequence[torch.Tensor], ndim: int, engine: str, shape: str
            ) -> list[torch.Tensor]:
    tensors = list(tensors)
    if len(tensors) != g.num_layers:
        raise ValueError(f"{engine}: group {g.name!r} has {g.num_layers} layers, got {len(tensors)} tensors")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{engine}: layer {i}: expected a {ndim}-D tensor {shape}, got {got}")
    return tensors


def _kernel_blocks_per_block(layout: BlockLayout, g: CacheGroup, layer: int, tokens: int, blocks: int) -> int:
    if tokens <= 0 or layout.block_size % tokens or blocks % (layout.block_size // tokens):
        raise ValueError(f"vllm group {g.name!r} layer {layer}: {blocks} blocks of {tokens} tokens cannot make "
                         f"blocks of the layout's {layout.block_size} tokens")
    return layout.block_size // tokens


def _pages(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """A token pool (num_tokens, ...) as pages (num_tokens // page_size, page_size, ...); a tail that is not
    a whole page is not addressable as a block."""
    pages = pool.shape[0] // page_size
    _expect(pages > 0, f"a token pool of {pool.shape[0]} tokens has no whole page of {page_size}")
    return pool[: pages * page_size].unflatten(0, (pages, page_size))


def _is_mla(g: CacheGroup) -> bool:
    return [name for name, _ in g.parts] == ["latent"]


def _k_dim(g: CacheGroup) -> int:
    shapes = dict(g.parts)
    return shapes["k"][-1] if "k" in shapes else shapes["kv"][-1] // 2 if "kv" in shapes else 0


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
