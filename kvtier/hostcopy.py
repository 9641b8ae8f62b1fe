"""Batched host-memory copies: one native call for a whole batch of rows (see native/cpu/memcopy.c).

``copy_rows(dst, src, nbytes)`` copies row i of ``src`` addresses to row i of ``dst`` addresses. The tables
are numpy uint64 arrays; the call releases the GIL. ``copy_fragments`` gathers/scatters packed KV blocks
from a fragment table (kvtier.kernels builds it). When the native library is missing (a source tree that
was never built, a platform without a C compiler at install) the same copies run through ctypes.memmove,
one call per row, after one logged warning: slower for small rows, never wrong.

``copy_threads(total_bytes, configured)`` answers how many threads a batch gets where the caller lets the batch
decide (``configured`` 0): two (at most the cores this process may run on) for a batch of PARALLEL_MIN_BYTES or
more while a core is spare (the 1-minute load average below usable cores - 1), one otherwise: a second thread
only pays where it gets a core of its own (README "Shared-memory copy threads" has the measurements).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import time

import numpy as np

from kvtier.config import ENV_NATIVE_CPU

log = logging.getLogger(__name__)

_u64p = ctypes.POINTER(ctypes.c_uint64)
_i64p = ctypes.POINTER(ctypes.c_int64)


def _load_native() -> ctypes.CDLL | None:
    if os.environ.get(ENV_NATIVE_CPU, "1") == "0":
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
    if hasattr(lib, "kvtier_copy_fragments"):  # absent in a library built before it existed
        lib.kvtier_copy_fragments.argtypes = [_i64p, ctypes.c_int64, _i64p, _u64p, ctypes.c_int64, ctypes.c_int,
                                              ctypes.c_int]
        lib.kvtier_copy_fragments.restype = ctypes.c_int
    return lib


_lib = _load_native()
NATIVE = _lib is not None

# The batch size from which two copy threads may beat one (UMBP's two-thread copy beats one thread 1.2-1.4x at
# 1-4 MiB blocks on a quiet 2-core machine: /work/shared/reference/MEASURED.md); below it a batch is a few blocks
# and the second thread's start (~30-60 us) eats the gain. On a machine whose cores are all busy (load average
# >= cores - 1) the second thread waits for a core: two threads ran at 0.3-0.9x of one on batches of 256 KiB to
# 16 MiB and tied at 64 MiB (2 cores at load 2-5, ``python -m kvtier.bench.shm_threads``), so the auto choice
# checks for a spare core too.
PARALLEL_MIN_BYTES = 1 << 20
AUTO_MAX_THREADS = 2  # a third thread gains nothing where two already saturate the memory bus
LOAD_CHECK_S = 1.0  # how often the auto choice re-reads the load average


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


_CORES = usable_cores()
_spare = (0.0, False)  # (when checked, monotonic; whether a core was spare then)


def spare_core() -> bool:
    """Whether a core is spare for a second copy thread: the 1-minute load average is below usable cores - 1
    (checked at most every LOAD_CHECK_S; False where there is no load average)."""
    global _spare
    now = time.monotonic()
    checked, spare = _spare
    if now - checked >= LOAD_CHECK_S:
        try:
            spare = os.getloadavg()[0] < _CORES - 1
        except OSError:
            spare = False
        _spare = (now, spare)
    return spare


def copy_threads(total_bytes: int, configured: int = 0) -> int:
    """The threads for one batched copy of ``total_bytes``: ``configured`` where it is >= 1, else (auto) up to
    AUTO_MAX_THREADS of the usable cores for a batch of PARALLEL_MIN_BYTES or more while a core is spare, and one
    for a smaller batch or on a busy machine."""
    if configured >= 1:
        return configured
    if total_bytes < PARALLEL_MIN_BYTES or _CORES < 2 or not spare_core():
        return 1
    return min(AUTO_MAX_THREADS, _CORES)


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


# Columns of a fragment table row (int64), shared with native/cpu/memcopy.c, native/cuda/packcopy.cu and the
# Triton kernel: for engine block id b, ``nruns`` runs of ``run_bytes``, run r at
#   engine  engine_base + b * block_stride + r * engine_run_stride
#   packed  packed_row + packed_offset + r * packed_run_stride
FRAGMENT_FIELDS = ("engine_base", "block_stride", "packed_offset", "run_bytes", "nruns", "engine_run_stride",
                   "packed_run_stride", "group")


def copy_fragments(frags: np.ndarray, block_ids: np.ndarray, packed: np.ndarray, scatter: bool,
                   threads: int = 1) -> None:
    """Gather (packed <- engine) or scatter (engine <- packed) every fragment of ``len(packed)`` blocks.

    ``frags``: int64 (F, 8) table (FRAGMENT_FIELDS); ``block_ids``: int64 (groups, N), -1 where a group has no
    engine block (a gather then writes zeros there, a scatter skips it); ``packed``: uint64 (N,) row
    addresses. The caller has validated ids and sizes: this only moves bytes.
    """
    frags = np.ascontiguousarray(frags, dtype=np.int64)
    ids = np.ascontiguousarray(block_ids, dtype=np.int64)
    rows = np.ascontiguousarray(packed, dtype=np.uint64)
    n = len(rows)
    if n == 0 or len(frags) == 0:
        return
    if _lib is not None and hasattr(_lib, "kvtier_copy_fragments"):
        _lib.kvtier_copy_fragments(frags.ctypes.data_as(_i64p), len(frags), ids.ctypes.data_as(_i64p),
                                   rows.ctypes.data_as(_u64p), n, int(scatter), threads)
        return
    dst, src, nbytes, zero_dst, zero_bytes = fragment_rows(frags, ids, rows, scatter)
    copy_rows(dst, src, nbytes, threads)
    for d, k in zip(zero_dst.tolist(), zero_bytes.tolist()):
        ctypes.memset(d, 0, k)


def fragment_rows(frags: np.ndarray, ids: np.ndarray, rows: np.ndarray, scatter: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fragment copy as plain rows (dst, src, nbytes), plus the (dst, nbytes) runs a gather zeroes.

    What the native loop does, spelled out with numpy, in the same (block, fragment, run) order: the
    fallback when the native library is missing.
    """
    frags = np.asarray(frags, dtype=np.int64)
    nruns = frags[:, 4]
    run_frag = np.repeat(np.arange(len(frags)), nruns)  # the fragment of every run
    run_index = np.arange(len(run_frag)) - np.repeat(np.cumsum(nruns) - nruns, nruns)
    f = frags[run_frag]  # one row per run
    engine_off = f[:, 0] + run_index * f[:, 5]
    packed_off = f[:, 2] + run_index * f[:, 6]
    block = ids[f[:, 7]].T  # (N, runs): the engine block id of every run of every packed row
    engine = (engine_off[None, :] + block * f[None, :, 1]).astype(np.uint64)
    packed = rows.astype(np.uint64)[:, None] + packed_off.astype(np.uint64)[None, :]
    nbytes = np.broadcast_to(f[:, 3].astype(np.uint64), block.shape)
    ok = block >= 0
    src, dst = (packed[ok], engine[ok]) if scatter else (engine[ok], packed[ok])
    if scatter:
        return dst, src, nbytes[ok], np.empty(0, np.uint64), np.empty(0, np.uint64)
    return dst, src, nbytes[ok], packed[~ok], nbytes[~ok]
