"""The cpu backend: engine KV and packed rows both in host memory, copied by native/cpu (hostcopy).

One native call per batch walks the fragment table for every block (streaming stores for runs of 16 KiB or
more, ``threads`` threads), releasing the GIL. Synchronous: the bytes are in place when copy() returns.
"""

from __future__ import annotations

import numpy as np

from kvtier.memory import hostcopy
from kvtier.kernels.dispatch import PackedRows
from kvtier.kernels.enginekv import EngineKV


class CpuBackend:
    """Stateless; safe to call from several threads at once (on disjoint buffers)."""

    name = "cpu"

    def unavailable(self, kv: EngineKV) -> str | None:
        return None if kv.device.type == "cpu" else f"the engine KV is on {kv.device}, not in host memory"

    def prepare(self, kv: EngineKV, rows: PackedRows) -> PackedRows | None:
        return rows if rows.device.type == "cpu" else None

    def copy(self, kv: EngineKV, ids: np.ndarray, rows: PackedRows, scatter: bool, align: int,
             threads: int) -> None:
        hostcopy.copy_fragments(kv.fragments, ids, rows.ptrs, scatter, threads)


BACKEND = CpuBackend()
