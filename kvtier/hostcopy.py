"""Batched host-memory copies: one native call for a whole batch of rows (see native/cpu/memcopy.c).

``copy_rows(dst, src, nbytes)`` copies row i of ``src`` addresses to row i of ``dst`` addresses. The tables
are numpy uint64 arrays; the call releases the GIL. When the native library is missing (a source tree that
was never built, a platform without a C compiler at install) the same copies run through ctypes.memmove,
one call per row, after one logged warning: slower for small rows, never wrong.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os

import numpy as np

log = logging.getLogger(__name__)

_u64p = ctypes.POINTER(ctypes.c_uint64)


def _load_native() -> ctypes.CDLL | None:
    if os.environ.get("KVTIER_NATIVE_CPU", "1") == "0":
        return None
    spec = importlib.util.find_spec("kvtier._native_cpu")
    if spec is None or not spec.origin:
        log.warning("kvtier native CPU copy library not built; host copies use one memmove per block "
                    "(reinstall kvtier with a C compiler present for full speed)")
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.kvtier_copy_rows.argtypes = [_u64p, _u64p, _u64p, ctypes.c_int64, ctypes.c_int]
    lib.kvtier_copy_rows.restype = ctypes.c_int
    lib.kvtier_native_abi_version.restype = ctypes.c_int
    if lib.kvtier_native_abi_version() != 1:
        log.warning("kvtier native CPU library has an unexpected ABI version; not using it")
        return None
    return lib


_lib = _load_native()
NATIVE = _lib is not None


def copy_rows(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray | int, threads: int = 1) -> None:
    """dst[i] <- src[i] for nbytes[i] bytes. All arrays uint64 and contiguous; rows must not overlap."""
    n = len(dst)
    if n == 0:
        return
    if len(src) != n:
        raise ValueError(f"copy_rows: {n} destinations but {len(src)} sources")
    sizes = np.full(n, nbytes, dtype=np.uint64) if np.isscalar(nbytes) else np.ascontiguousarray(nbytes, np.uint64)
    dst = np.ascontiguousarray(dst, dtype=np.uint64)
    src = np.ascontiguousarray(src, dtype=np.uint64)
    if _lib is not None:
        _lib.kvtier_copy_rows(dst.ctypes.data_as(_u64p), src.ctypes.data_as(_u64p), sizes.ctypes.data_as(_u64p),
                              n, threads)
        return
    memmove = ctypes.memmove
    for d, s, k in zip(dst.tolist(), src.tolist(), sizes.tolist()):
        memmove(d, s, k)
