"""HostPages: an SGLang host pool's pages as kvtier blocks, and the copy tables between the two.

SGLang's host pool says where a page's bytes are with ``get_page_buffer_meta(host_indices)``: a list of
segments per page (pointer, size), in an order of its own (SGLANG-HICACHE.md):

| pool / layout                      | segments per page | kvtier block                                  |
|------------------------------------|-------------------|-----------------------------------------------|
| MHA ``layer_first``                | 2L: K0 V0 K1 V1.. | the 2L segments end to end                    |
| MHA ``page_first`` / ``_direct`` / ``page_head`` | 2: K, V | K then V                            |
| MLA ``layer_first``                | L                 | the L segments end to end                     |
| MLA ``page_first`` / ``_direct``   | 1                 | the page itself (read and written in place)   |

A kvtier block is the page's segments concatenated in that order (``offsets``), so a page moves with one
batched copy per direction (``CopyThreads.copy``: one native call for a whole batch of segments). The bytes keep
SGLang's host layout, so the block's namespace fingerprints what decides them: pool class, layout, dtype,
page size, segment sizes, and the interface (v1 pages in segment order; ``interface_v1`` off: SGLang's flat
data pages, whose order differs for MHA ``layer_first``).

Thread-safe (immutable after construction). Reads the host pool's memory only inside the calls that copy.
No SGLang import: the pool is used through ``get_page_buffer_meta``, ``page_size``, ``layout``, ``dtype``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.memory.hostcopy import CopyThreads

GEOMETRY_VERSION = 1


class PageGeometryError(ValueError):
    """The host pool answered with segments this backend did not register (another count or sizes)."""


class HostPages:
    """Page geometry of one host pool (``interface`` "v1" or "flat"), fixed at registration."""

    def __init__(self, pool: Any, *, interface: str = "v1", copy_threads: int = 1) -> None:
        if interface not in ("v1", "flat"):
            raise ValueError(f"interface must be v1 or flat, got {interface!r}")
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.interface = interface
        self.copy_threads = copy_threads
        # Each direction timed on its own (copy_threads 0: by measured rate, kvtier.memory.hostcopy.CopyThreads).
        self._copies = {True: CopyThreads(copy_threads), False: CopyThreads(copy_threads)}  # by to_blocks
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not sizes or len(ptrs) != len(sizes) or any(int(s) <= 0 for s in sizes):
            raise PageGeometryError(f"{type(pool).__name__} ({pool.layout}) describes a page as pointers {len(ptrs)} "
                                    f"and sizes {list(sizes)[:8]}: kvtier cannot store such pages")
        self.segment_bytes = np.asarray(sizes, dtype=np.uint64)
        self.segments = len(sizes)
        self.offsets = np.concatenate([[0], np.cumsum(self.segment_bytes)[:-1]]).astype(np.uint64)
        self.block_bytes = int(self.segment_bytes.sum())
        if interface == "flat":
            flat = pool.get_dummy_flat_data_page()
            flat_bytes = flat.numel() * flat.element_size()
            if flat_bytes != self.block_bytes:
                raise PageGeometryError(f"{type(pool).__name__} ({pool.layout}): a flat data page has {flat_bytes} B "
                                        f"but its segments {self.block_bytes} B")
        desc = {"v": GEOMETRY_VERSION, "engine": "sglang", "pool": type(pool).__name__, "layout": str(pool.layout),
                "dtype": str(pool.dtype).removeprefix("torch."), "page_size": self.page_size,
                "segments": [int(s) for s in sizes], "interface": interface}
        self.description = desc
        self.fingerprint = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def contiguous(self) -> bool:
        """One segment per page: the store reads and writes the host page itself (no copy of ours)."""
        return self.segments == 1

    def segment_ptrs(self, host_indices: torch.Tensor, pages: int) -> np.ndarray:
        """(pages, segments) uint64 addresses of the pages at ``host_indices`` (page i: tokens
        [i * page_size, (i + 1) * page_size)). ValueError / PageGeometryError on a mismatch."""
        if host_indices.dim() != 1 or host_indices.numel() != pages * self.page_size:
            raise ValueError(f"{pages} page keys need {pages * self.page_size} host indices, got "
                             f"{tuple(host_indices.shape)}")
        if pages == 0:
            return np.empty((0, self.segments), dtype=np.uint64)
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self.segments or len(sizes) != len(ptrs):
            raise PageGeometryError(f"the host pool gave {len(ptrs)} segments for {pages} pages; registered "
                                    f"{self.segments} per page")
        if not (np.asarray(sizes, dtype=np.uint64).reshape(pages, self.segments) == self.segment_bytes).all():
            raise PageGeometryError("the host pool's segment sizes changed since registration")
        return np.asarray(ptrs, dtype=np.uint64).reshape(pages, self.segments)

    def to_blocks(self, segments: np.ndarray, blocks: np.ndarray) -> None:
        """Copy pages (rows of segment addresses) into blocks (one address each): one batched copy."""
        self._copy(segments, blocks, to_blocks=True)

    def from_blocks(self, blocks: np.ndarray, segments: np.ndarray) -> None:
        """Copy blocks (one address each) into pages (rows of segment addresses): one batched copy."""
        self._copy(segments, blocks, to_blocks=False)

    def _copy(self, segments: np.ndarray, blocks: np.ndarray, *, to_blocks: bool) -> None:
        n = len(blocks)
        if n == 0:
            return
        if segments.shape != (n, self.segments):
            raise ValueError(f"{n} blocks but segment table {segments.shape}")
        inside = (np.asarray(blocks, dtype=np.uint64)[:, None] + self.offsets[None, :]).ravel()
        sizes = np.broadcast_to(self.segment_bytes, (n, self.segments)).ravel()
        outside = np.ascontiguousarray(segments, dtype=np.uint64).ravel()
        dst, src = (inside, outside) if to_blocks else (outside, inside)
        self._copies[to_blocks].copy(dst, src, sizes)

    def describe(self) -> str:
        d = self.description
        return (f"{d['pool']} {d['layout']} {d['dtype']} page {self.page_size}: {self.segments} segment"
                f"{'s' if self.segments > 1 else ''} of {int(self.segment_bytes[0])} B per page, block "
                f"{self.block_bytes} B, interface {self.interface}, fp {self.fingerprint}")


def page_keys_ok(keys: Sequence[Any]) -> bool:
    """SGLang page keys are non-empty strings (hex sha256)."""
    return all(isinstance(k, str) and k for k in keys)
