"""The cuda backend: native/cuda/packcopy.cu, built with nvcc on first use and called through ctypes.

One launch per batch on the current stream of the engine's device (asynchronous: synchronize that stream
before reading a gathered buffer or reusing a scattered one). Packed rows in device memory are used as is;
rows in pinned host memory are mapped into the device's address space and written (or read) by the kernel
directly, with no staging copy; unpinned host rows go through staging (dispatch.py).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
import torch

from kvtier.kernels import native_build
from kvtier.kernels.dispatch import KernelError, PackedRows, upload_ids_and_rows
from kvtier.kernels.enginekv import EngineKV

log = logging.getLogger(__name__)

_ABI_VERSION = 1
_CTAS_PER_SM = 8  # enough resident CTAs to keep every SM's memory pipeline full


class _Library:
    """The loaded launcher library, or why it cannot be loaded (built once per process, under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None
        self._tried = False

    def get(self) -> tuple[ctypes.CDLL | None, str | None]:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._lib = load(native_build.build_cuda_library())
                except (native_build.BuildError, OSError) as e:
                    self._error = str(e)
                    log.warning("kvtier CUDA copy kernels unavailable (GPU copies fall back to triton or torch): %s",
                                e)
            return self._lib, self._error


def load(path: object) -> ctypes.CDLL:
    """Load a built library and declare its entry points (see packcopy.cu)."""
    lib = ctypes.CDLL(str(path))
    i64, u64p = ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)
    lib.kvtier_cuda_copy_fragments.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_void_p, i64,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.kvtier_cuda_copy_fragments.restype = ctypes.c_int
    lib.kvtier_cuda_device_pointers.argtypes = [u64p, u64p, i64]
    lib.kvtier_cuda_device_pointers.restype = i64
    lib.kvtier_cuda_sm_count.restype = ctypes.c_int
    lib.kvtier_cuda_error_string.argtypes = [ctypes.c_int]
    lib.kvtier_cuda_error_string.restype = ctypes.c_char_p
    lib.kvtier_cuda_abi_version.restype = ctypes.c_int
    if lib.kvtier_cuda_abi_version() != _ABI_VERSION:
        raise OSError(f"{path}: unexpected ABI version {lib.kvtier_cuda_abi_version()} (want {_ABI_VERSION})")
    return lib


def error_string(lib: ctypes.CDLL, rc: int) -> str:
    return f"CUDA error {rc}: {lib.kvtier_cuda_error_string(rc).decode(errors='replace')}"


_LIBRARY = _Library()


class CudaBackend:
    """Holds the process's one launcher library; thread-safe (launches are, and loading is locked)."""

    name = "cuda"

    def __init__(self) -> None:
        self._sms: dict[int, int] = {}

    def unavailable(self, kv: EngineKV) -> str | None:
        if kv.device.type != "cuda":
            return f"the engine KV is on {kv.device}, not a GPU"
        if torch.version.cuda is None:
            return "this torch build has no CUDA (on ROCm use the triton backend)"
        lib, error = _LIBRARY.get()
        return None if lib is not None else f"the CUDA kernels are not available: {error}"

    def prepare(self, kv: EngineKV, rows: PackedRows) -> PackedRows | None:
        if rows.device == kv.device:
            return rows
        if rows.device.type != "cpu":
            return None
        lib = self._lib()
        out = np.empty_like(rows.ptrs)
        src = np.ascontiguousarray(rows.ptrs)
        one_allocation = rows.tensor is not None and len(src) > 0  # map its first row, offset the rest
        with torch.cuda.device(kv.device):
            rc = lib.kvtier_cuda_device_pointers(_u64(src), _u64(out), 1 if one_allocation else len(src))
        if rc == 0 and one_allocation:
            out[:] = out[0] + (src - src[0])
        if rc > 0:
            return None  # not page-locked: stage
        if rc < 0:
            raise KernelError(f"cannot map packed host rows for {kv.device}: {error_string(lib, int(-rc))}")
        return PackedRows(out, kv.device, rows.tensor)

    def copy(self, kv: EngineKV, ids: np.ndarray, rows: PackedRows, scatter: bool, align: int,
             threads: int) -> None:
        lib = self._lib()
        nblocks = ids.shape[1]
        with torch.cuda.device(kv.device):
            meta = upload_ids_and_rows(ids, rows, kv.device)
            table = kv.table_on(kv.device)
            items = len(kv.fragments) * nblocks
            grid = max(1, min(items, self._sm_count(lib, kv.device) * _CTAS_PER_SM))
            stream = torch.cuda.current_stream(kv.device).cuda_stream
            rc = lib.kvtier_cuda_copy_fragments(table.data_ptr(), len(kv.fragments), meta.data_ptr(),
                                                meta.data_ptr() + ids.size * 8, nblocks, int(scatter), align,
                                                grid, stream)
        if rc != 0:
            raise KernelError(f"cuda {'scatter' if scatter else 'gather'} of {nblocks} blocks failed to launch: "
                              f"{error_string(lib, rc)}")

    def _lib(self) -> ctypes.CDLL:
        lib, error = _LIBRARY.get()
        if lib is None:
            raise KernelError(f"the CUDA kernels are not available: {error}")
        return lib

    def _sm_count(self, lib: ctypes.CDLL, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sms:
            sms = lib.kvtier_cuda_sm_count()
            self._sms[index] = sms if sms > 0 else 132
        return self._sms[index]


def _u64(a: np.ndarray) -> ctypes._Pointer:  # type: ignore[type-arg]
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))


BACKEND = CudaBackend()
