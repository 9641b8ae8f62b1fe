"""The triton backend: one Triton kernel launch per batch, for NVIDIA and AMD GPUs alike.

The same fragment walk as native/cuda/packcopy.cu (program i copies one fragment of one block), written
once in Triton so that GPUs without our CUDA build (ROCm, or no nvcc) still get one launch per batch.
Engine and packed addresses come from int64 tables, so the kernel takes any number of engine tensors.
Asynchronous on the current stream of the engine's device. On CPU tensors it runs only in Triton's
interpreter (TRITON_INTERPRET=1 set before triton is imported), which is how the tests exercise it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.kernels.dispatch import KernelError, PackedRows, triton_interpreted, upload_ids_and_rows
from kvtier.kernels.enginekv import EngineKV

_BLOCK = 1024  # elements per program step
# Element types by width. Addresses come from int64 tables, so Triton cannot prove alignment and issues one
# access of this width per element (8 bytes at most): coalesced, but not the 16-byte vectors of packcopy.cu.


@triton.jit
def _copy_fragments(frags, ids, rows, nfrags, nblocks, SCATTER: tl.constexpr, ELEM: tl.constexpr,
                    W: tl.constexpr, BLOCK: tl.constexpr):
    item = tl.program_id(0).to(tl.int64)
    i = item // nfrags
    f = frags + (item - i * nfrags) * 8  # one 8-column row of the table: see hostcopy.FRAGMENT_FIELDS
    engine_base = tl.load(f + 0)
    block_stride = tl.load(f + 1)
    packed_offset = tl.load(f + 2)
    run_bytes = tl.load(f + 3)
    nruns = tl.load(f + 4)
    group = tl.load(f + 7)
    bid = tl.load(ids + group * nblocks + i)
    packed_addr = tl.load(rows + i) + packed_offset
    if bid >= 0:
        engine = (engine_base + bid * block_stride).to(tl.pointer_type(ELEM))
        packed = packed_addr.to(tl.pointer_type(ELEM))
        if nruns == 1:  # one contiguous run (the common case): no index arithmetic per element
            n = (run_bytes // W).to(tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                if SCATTER:
                    tl.store(engine + offs, tl.load(packed + offs, mask=mask), mask=mask)
                else:
                    tl.store(packed + offs, tl.load(engine + offs, mask=mask), mask=mask)
        else:
            run = (run_bytes // W).to(tl.int32)  # in ELEM units from here on; 32-bit index math is cheap
            engine_run_stride = tl.load(f + 5) // W
            packed_run_stride = tl.load(f + 6) // W
            total = run * nruns.to(tl.int32)
            for start in range(0, total, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < total
                r = offs // run
                w = offs - r * run
                e = engine + r.to(tl.int64) * engine_run_stride + w
                p = packed + r.to(tl.int64) * packed_run_stride + w
                if SCATTER:
                    tl.store(e, tl.load(p, mask=mask), mask=mask)
                else:
                    tl.store(p, tl.load(e, mask=mask), mask=mask)
    elif not SCATTER:
        # No engine block for this group, or alignment padding: zeros, so equal KV packs to equal bytes.
        # Byte stores: padding need not be aligned to the vector width of the copies.
        zero_stride = tl.load(f + 6)
        zero_total = (run_bytes * nruns).to(tl.int32)
        zero_run = run_bytes.to(tl.int32)
        packed_bytes = packed_addr.to(tl.pointer_type(tl.uint8))
        for start in range(0, zero_total, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            r = offs // zero_run
            tl.store(packed_bytes + r.to(tl.int64) * zero_stride + (offs - r * zero_run),
                     tl.zeros([BLOCK], tl.uint8), mask=offs < zero_total)


_ELEM = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}


class TritonBackend:
    """Stateless; launches are thread-safe as torch's are."""

    name = "triton"

    def unavailable(self, kv: EngineKV) -> str | None:
        if kv.device.type == "cpu":
            return None if triton_interpreted() else (
                "Triton runs on CPU tensors only in its interpreter (set TRITON_INTERPRET=1 before import)")
        if kv.device.type == "cuda":  # NVIDIA, and AMD through torch's ROCm build
            return None
        return f"Triton does not run on {kv.device.type} devices"

    def prepare(self, kv: EngineKV, rows: PackedRows) -> PackedRows | None:
        return rows if rows.device == kv.device else None

    def copy(self, kv: EngineKV, ids: np.ndarray, rows: PackedRows, scatter: bool, align: int,
             threads: int) -> None:
        width = min(align, 8)
        nblocks = ids.shape[1]
        meta = upload_ids_and_rows(ids, rows, kv.device)
        grid = (len(kv.fragments) * nblocks,)
        on_device = torch.cuda.device(kv.device) if kv.device.type == "cuda" else contextlib.nullcontext()
        try:
            with on_device:  # Triton launches on the current device's current stream
                _copy_fragments[grid](kv.table_on(kv.device), meta[:ids.size], meta[ids.size:], len(kv.fragments),
                                      nblocks, SCATTER=scatter, ELEM=_ELEM[width], W=width, BLOCK=_BLOCK)
        except Exception as e:  # compile or launch errors come as many types; name the call that failed
            raise KernelError(f"triton {'scatter' if scatter else 'gather'} of {nblocks} blocks failed: {e}") from e


BACKEND = TritonBackend()
