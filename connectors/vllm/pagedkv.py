"""PagedKV: one vLLM worker's KV cache tensors seen as kvtier packed blocks.

vLLM 0.33 hands the worker-side connector a dict layer name -> tensor, each a logical (num_blocks, H, N, C)
view (K and V side by side on C; MLA: H == 1, C = kv_lora_rank + rope_dim) of one int8 allocation, in the
physical order the resolved KV cache layout picked, possibly split into kernel blocks. A packed block holds
every layer of one manager block. The layout is derived from the tensors themselves (per-rank heads, dtype,
head sizes), so it is exactly what this rank holds, and its fingerprint goes into the key namespace.

Copies go through kvtier.kernels: a save gathers all layers of a batch of blocks in one call; a load
scatters layer by layer (one EngineKV per layer over that layer's byte range of the packed block), so the
attention layer that needs layer i waits for layer i only.

Built once in the worker process when vLLM registers its KV caches; immutable afterwards, and safe to use
from the worker's copy threads. Holds references to the engine tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.blocks import BlockRows
from kvtier.kernels import EngineKV, gather, scatter, vllm_sources
from kvtier.layout import BlockLayout, CacheGroup, canonical_dtype


@dataclass(frozen=True)
class LayerCopy:
    """One layer's bytes inside a packed block (``offset``, ``nbytes``) and the map to its engine tensor."""

    name: str
    offset: int
    nbytes: int
    kv: EngineKV


class PagedKV:
    """The worker's paged KV as packed blocks of ``layout``. ``layer_names`` gives the order (vLLM's cache
    group order); tensors several layers share (cross-layer KV sharing) are one layer here, and every name
    that maps to it waits on it."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], block_size: int,
                 mla: bool = False) -> None:
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache tensors")
        names = [n for n in layer_names if n in kv_caches] + [n for n in kv_caches if n not in set(layer_names)]
        tensors: list[torch.Tensor] = []
        self.index_of: dict[str, int] = {}
        seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
        for name in names:
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"KV cache of layer {name!r}: expected vLLM >= 0.33's (num_blocks, num_kv_heads, "
                                 f"block_size, head_size + head_size_v) view, got {shape}")
            ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if ident not in seen:
                seen[ident] = len(tensors)
                tensors.append(t)
            self.index_of[name] = seen[ident]
        self.block_size = block_size
        self.device = tensors[0].device
        # Consecutive layers with one shape and dtype form one layout group (one, unless head sizes vary).
        runs: list[tuple[CacheGroup, list[torch.Tensor]]] = []
        for t in tensors:
            parts, kind = _parts(t, block_size, mla)
            dtype = canonical_dtype(t.dtype)
            if runs and runs[-1][0].parts == parts and runs[-1][0].dtype == dtype:
                group, members = runs[-1]
                runs[-1] = (CacheGroup(group.name, kind, group.num_layers + 1, parts, dtype), members + [t])
            else:
                runs.append((CacheGroup(f"{kind}{len(runs)}", kind, 1, parts, dtype), [t]))
        self.layout = BlockLayout(block_size, tuple(g for g, _ in runs))
        sources = []
        for group, members in runs:
            sources += vllm_sources(self.layout, members, group=group.name)
        self.engine = EngineKV(self.layout, sources)
        self.layers: list[LayerCopy] = []
        for group, members in runs:
            one = BlockLayout(block_size, (CacheGroup(group.name, group.kind, 1, group.parts, group.dtype),),
                              self.layout.align)
            for i, t in enumerate(members):
                offset = self.layout.region(group.name, i, group.parts[0][0]).offset
                self.layers.append(LayerCopy(f"{group.name}[{i}]", offset, one.nbytes,
                                             EngineKV(one, vllm_sources(one, [t]))))
        self.num_blocks = min(self.engine.num_blocks.values())

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def gather(self, block_ids: np.ndarray, packed: torch.Tensor | BlockRows) -> None:
        """packed[i] <- every layer of engine block block_ids[i]: a row of an (N, nbytes) tensor, or the block at
        address ``packed.ptrs[i]`` (a DRAM slot). GPU: asynchronous on the current stream."""
        gather(self.engine, block_ids, packed)

    def scatter_layer(self, layer: int, block_ids: np.ndarray, packed: torch.Tensor | BlockRows) -> None:
        """Layer ``layer`` of engine block block_ids[i] <- its bytes in packed block i: a row of an (N,
        nbytes) tensor, or the block at address ``packed.ptrs[i]`` (e.g. a DRAM slot). SKIP (-1) ids are left
        untouched. GPU: asynchronous on the current stream."""
        copy = self.layers[layer]
        if isinstance(packed, BlockRows):
            rows: torch.Tensor | BlockRows = BlockRows(packed.ptrs + np.uint64(copy.offset), packed.owners)
        else:
            rows = packed[:, copy.offset : copy.offset + copy.nbytes]
        scatter(copy.kv, block_ids, rows)

    def describe(self) -> str:
        return f"{self.num_layers} layers, {self.num_blocks} engine blocks on {self.device}; {self.layout.describe()}"


def _parts(t: torch.Tensor, block_size: int, mla: bool) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], str]:
    _, heads, _, width = (int(d) for d in t.shape)
    if mla:
        if heads != 1:
            raise ValueError(f"an MLA KV cache has one head per block, got {tuple(t.shape)}")
        return (("latent", (block_size, width)),), "mla"
    return (("kv", (block_size, heads, width)),), "attention"
