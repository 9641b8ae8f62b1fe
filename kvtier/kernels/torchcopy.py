"""The torch backend: plain torch indexing, one index_select / index_copy_ per engine view.

Runs wherever torch does (any device, no compiler, no Triton), so it is the last resort of the automatic
choice; it launches one copy per (layer, part) instead of one per batch, which is what the kernels exist to
avoid. Same stream semantics as the device's other torch ops.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.kernels.dispatch import PackedRows
from kvtier.kernels.enginekv import EngineKV, KVSource


class TorchBackend:
    """Stateless; thread-safe as torch ops are."""

    name = "torch"

    def unavailable(self, kv: EngineKV) -> str | None:
        return None

    def prepare(self, kv: EngineKV, rows: PackedRows) -> PackedRows | None:
        return rows if rows.tensor is not None and rows.device == kv.device else None

    def copy(self, kv: EngineKV, ids: np.ndarray, rows: PackedRows, scatter: bool, align: int,
             threads: int) -> None:
        if rows.tensor is None:
            raise ValueError("the torch backend needs the packed rows as a tensor")
        index = [_RowIndex(row, kv.device) for row in ids[:len(kv.layout.groups)]]  # uploaded once per call
        group_index = {g.name: i for i, g in enumerate(kv.layout.groups)}
        for s in kv.sources:
            rows_of = index[group_index[s.region.group]]
            packed, engine = _packed_view(rows.tensor, s), _as_int(s.view)
            if scatter:
                engine.index_copy_(0, rows_of.ids, packed if rows_of.every else packed[rows_of.rows])
            elif rows_of.every:
                packed.copy_(engine.index_select(0, rows_of.ids))
            else:
                packed[rows_of.rows] = engine.index_select(0, rows_of.ids)
                packed[rows_of.skipped] = 0
        if not scatter:
            for offset, nbytes in kv.padding:
                rows.tensor[:, offset:offset + nbytes] = 0


class _RowIndex:
    """One group's block ids on the device: ``ids`` of the rows that have one (``rows``), rows that skip."""

    def __init__(self, row: np.ndarray, device: torch.device) -> None:
        keep = row >= 0
        self.every = bool(keep.all())
        self.ids = torch.from_numpy(row[keep]).to(device, non_blocking=True)
        self.rows = torch.from_numpy(np.flatnonzero(keep)).to(device, non_blocking=True)
        self.skipped = torch.from_numpy(np.flatnonzero(~keep)).to(device, non_blocking=True)


# Elements move as integers of their width: bit-exact for every dtype (no NaN rewriting), and index ops exist
# for them on every device (not so for fp8).
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _packed_view(packed: torch.Tensor, s: KVSource) -> torch.Tensor:
    """The rows' bytes of ``s``'s region, as integers shaped like the engine view (N, *S)."""
    r = s.region
    typed = packed[:, r.offset:r.offset + r.nbytes].view(_INT_OF_WIDTH[s.view.element_size()])
    typed = typed.view(packed.shape[0], *r.shape)
    if s.select:
        typed = typed[(slice(None), *s.select)]
    return typed.view(packed.shape[0], *s.view.shape[1:])


BACKEND = TorchBackend()
