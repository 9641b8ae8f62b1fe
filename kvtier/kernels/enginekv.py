"""EngineKV: where each byte of a packed block lives in the engine's paged KV tensors.

Engines keep KV per layer in paged tensors whose shapes and strides differ by engine, version and attention
backend; a packed block (``BlockLayout``) keeps one contiguous region per (group, layer, part). The map
between the two is a list of ``KVSource``: a strided view of engine memory, shaped ``(num_engine_blocks,
*S)``, whose block ``b`` holds, in row-major order, the elements of one region (or of a slice of it, say the
K half of a fused "kv" part) for engine block ``b``. ``EngineKV`` checks that the sources cover every region
exactly once, then compiles them into a *fragment table*: runs of bytes the copy kernels move without
knowing anything about engines (one int64 row per fragment, columns ``hostcopy.FRAGMENT_FIELDS``).

Compiling coalesces the dimensions that are contiguous on both sides, so the common cases are one fragment
per layer and part: vLLM 0.33's (B, N, H, C) pages against a fused "kv" part is one run per layer and
block; the same pages against separate k/v parts are N*H runs of head_size bytes with two strides.

engines.py builds the sources for vLLM (0.33 and older), FlashInfer, MLA and SGLang token pools.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.memory.hostcopy import FRAGMENT_FIELDS
from kvtier.layout import DTYPE_BYTES, BlockLayout, Region

_RAW_BYTES = ("uint8", "int8")  # engines keep fp8 KV in byte tensors; moved as bytes either way
# Fragment columns that are addresses or byte counts: their common alignment bounds the vector width.
_BYTE_FIELDS = tuple(FRAGMENT_FIELDS.index(f) for f in (
    "engine_base", "block_stride", "packed_offset", "run_bytes", "engine_run_stride", "packed_run_stride"))


@dataclass(frozen=True)
class KVSource:
    """Engine view ``view`` (shape ``(num_engine_blocks, *S)``) fills ``region[select]`` of every packed block.

    ``select`` indexes the region's elements shaped as ``region.shape`` (e.g. ``(..., slice(0, 128))`` for
    the K half of a fused kv part); ``S`` equals the selected shape, or splits some of its dimensions (an
    engine that keeps a 64-token block as 4 kernel blocks of 16 gives ``(4, 16, H, D)`` for ``(64, H, D)``).
    """

    region: Region
    view: torch.Tensor
    select: tuple[Any, ...] = ()


class EngineKV:
    """The fragment table of one engine's paged KV for one ``BlockLayout``: built once, used by every copy.

    Built in the engine's worker process when its KV tensors are allocated (vLLM's register_kv_caches). Holds
    references to the engine tensors, so their memory stays valid while this object lives; the engine must
    not reallocate them (if it does, build a new EngineKV). Immutable after construction and safe to share
    between threads; the per-device copy of the table is cached on first use.
    """

    def __init__(self, layout: BlockLayout, sources: Iterable[KVSource]) -> None:
        self.layout = layout
        self.sources = tuple(sources)
        if not self.sources:
            raise ValueError("EngineKV needs at least one source")
        devices = {s.view.device for s in self.sources}
        if len(devices) != 1:
            raise ValueError(f"all engine KV tensors must be on one device, got {sorted(map(str, devices))}")
        self.device: torch.device = devices.pop()
        group_index = {g.name: i for i, g in enumerate(layout.groups)}
        blocks: dict[str, int] = {}
        rows: list[list[int]] = []
        align = 0
        for s in self.sources:
            _check_source(layout, s)
            for frag in _compile(s, group_index[s.region.group]):
                rows.append(frag)
                align = math.gcd(align, *(frag[k] for k in _BYTE_FIELDS))
            n = int(s.view.shape[0])
            blocks[s.region.group] = min(blocks.get(s.region.group, n), n)
        _check_coverage(layout, self.sources)
        # The alignment padding between regions: fragments of a pseudo-group whose block id is always SKIP,
        # so a gather writes zeros there (a packed block's bytes depend only on the KV) and a scatter skips.
        self.padding = _gaps(layout)
        rows += [[0, 0, offset, size, 1, size, size, len(layout.groups)] for offset, size in self.padding]
        self.fragments = np.array(rows, dtype=np.int64).reshape(-1, len(FRAGMENT_FIELDS))
        # Largest power of two (<= 16) dividing every address, stride and size: the widest safe vector.
        self.align = min(16, align & -align) if align else 16
        self.num_blocks = {g.name: blocks.get(g.name, 0) for g in layout.groups}
        self._tables: dict[torch.device, torch.Tensor] = {}

    @property
    def block_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def id_rows(self) -> int:
        """Rows of the block-id table the kernels read: one per cache group, one more (all SKIP) for the
        padding fragments when the layout has padding."""
        return len(self.layout.groups) + (1 if self.padding else 0)

    def table_on(self, device: torch.device) -> torch.Tensor:
        """The fragment table as an int64 tensor on ``device`` (uploaded once, then cached)."""
        table = self._tables.get(device)
        if table is None:
            table = torch.from_numpy(self.fragments).to(device)
            self._tables[device] = table
        return table

    def describe(self) -> str:
        runs = int(self.fragments[:, 4].sum())
        return (f"EngineKV({len(self.fragments)} fragments, {runs} runs per packed block of "
                f"{self.layout.nbytes} B, {self.align}-byte aligned, on {self.device}; engine blocks "
                + ", ".join(f"{g}: {n}" for g, n in self.num_blocks.items()) + ")")

    def __repr__(self) -> str:
        return self.describe()


def region_of(layout: BlockLayout, group: str, layer: int, part: str) -> Region:
    try:
        return layout.region(group, layer, part)
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None


def _selected(region: Region, select: tuple[Any, ...]) -> torch.Tensor:
    """The region's elements as a meta tensor (no memory), indexed by ``select``: its strides and offset are
    where the selection lies inside the region."""
    whole = torch.empty(region.shape, dtype=torch.uint8, device="meta")
    try:
        return whole[select] if select else whole
    except (IndexError, TypeError) as e:
        raise ValueError(f"region {_name(region)} {region.shape}: bad select {select!r}: {e}") from None


def _check_source(layout: BlockLayout, s: KVSource) -> None:
    r = s.region
    if region_of(layout, r.group, r.layer, r.part) != r:
        raise ValueError(f"region {_name(r)} is not a region of this layout")
    v = s.view
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        raise ValueError(f"region {_name(r)}: the engine view must be a tensor (num_blocks, ...), got "
                         f"{type(v).__name__} {tuple(getattr(v, 'shape', ()))}")
    dtype = str(v.dtype).removeprefix("torch.")
    if v.element_size() != DTYPE_BYTES[r.dtype] or (dtype != r.dtype and not (
            v.element_size() == 1 and (dtype in _RAW_BYTES or r.dtype in _RAW_BYTES))):
        raise ValueError(f"region {_name(r)}: engine tensor dtype {dtype} does not match the layout's {r.dtype}")
    sel = tuple(_selected(r, s.select).shape)
    if not _splits(tuple(v.shape[1:]), sel):
        raise ValueError(f"region {_name(r)}: engine view shape {tuple(v.shape[1:])} per block does not match "
                         f"the region's {sel}" + (f" (select {s.select!r})" if s.select else ""))
    if v.shape[0] == 0:
        raise ValueError(f"region {_name(r)}: the engine tensor has no blocks")
    if v.shape[0] > 1 and v.stride(0) == 0:
        raise ValueError(f"region {_name(r)}: the engine view's block stride is 0 (a broadcast view)")


def _splits(fine: tuple[int, ...], coarse: tuple[int, ...]) -> bool:
    """True if ``fine`` is ``coarse`` with some dimensions split into consecutive factors."""
    fine = tuple(d for d in fine if d != 1)
    coarse = tuple(d for d in coarse if d != 1)
    i = 0
    for d in coarse:
        prod = 1
        while prod < d and i < len(fine):
            prod *= fine[i]
            i += 1
        if prod != d:
            return False
    return i == len(fine)


def _compile(s: KVSource, group: int) -> list[list[int]]:
    """Fragment rows for one source: coalesce dims contiguous on both sides, make the innermost contiguous
    run the copy unit, the longest remaining dim the run loop, and one fragment per index of the others."""
    es = s.view.element_size()
    dst = _selected(s.region, s.select).view(tuple(s.view.shape[1:]))
    # (size, engine stride, packed stride) per dim, in bytes, size-1 dims dropped.
    dims = [(n, e * es, p * es) for n, e, p in zip(s.view.shape[1:], s.view.stride()[1:], dst.stride()) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, e, p in dims:
        if merged and merged[-1][1] == e * n and merged[-1][2] == p * n:
            merged[-1] = (merged[-1][0] * n, e, p)  # outer dim continues the inner one on both sides
        else:
            merged.append((n, e, p))
    if merged and merged[-1][1] == es and merged[-1][2] == es:
        run = merged.pop()[0] * es
    else:
        run = es
    if merged:
        loop = max(range(len(merged)), key=lambda k: merged[k][0])
        nruns, e_stride, p_stride = merged.pop(loop)
    else:
        nruns, e_stride, p_stride = 1, run, run
    base = s.view.data_ptr()
    block_stride = s.view.stride(0) * es
    packed = s.region.offset + dst.storage_offset() * es
    frags = []
    for idx in itertools.product(*(range(n) for n, _, _ in merged)):
        e_off = sum(i * e for i, (_, e, _) in zip(idx, merged))
        p_off = sum(i * p for i, (_, _, p) in zip(idx, merged))
        frags.append([base + e_off, block_stride, packed + p_off, run, nruns, e_stride, p_stride, group])
    return frags


def _check_coverage(layout: BlockLayout, sources: Sequence[KVSource]) -> None:
    """Every element of every region filled exactly once (a hole would gather garbage, an overlap is a bug)."""
    by_region: dict[Region, list[KVSource]] = {}
    for s in sources:
        by_region.setdefault(s.region, []).append(s)
    missing = [r for r in layout.regions if r not in by_region]
    if missing:
        names = ", ".join(_name(r) for r in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"no engine tensor for {len(missing)} layout region(s): {names}")
    for r, group in by_region.items():
        if len(group) == 1 and not group[0].select:
            continue
        count = torch.zeros(r.shape, dtype=torch.int16)
        for s in group:
            count[s.select if s.select else ...] += 1
        if not bool((count == 1).all()):
            raise ValueError(f"region {_name(r)}: the engine views " + (
                "overlap" if bool((count > 1).any()) else "leave part of it uncovered"))


def _gaps(layout: BlockLayout) -> list[tuple[int, int]]:
    """(offset, nbytes) of every byte of a packed block that no region holds."""
    gaps, end = [], 0
    for r in sorted(layout.regions, key=lambda r: r.offset):
        if r.offset > end:
            gaps.append((end, r.offset - end))
        end = max(end, r.offset + r.nbytes)
    if layout.nbytes > end:
        gaps.append((end, layout.nbytes - end))
    return gaps


def _name(r: Region) -> str:
    return f"({r.group!r}, layer {r.layer}, {r.part!r})"
