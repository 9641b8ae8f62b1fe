"""Batched host-memory copies: one native call for a whole batch of rows (see native/cpu/memcopy.c).

``copy_rows(dst, src, nbytes)`` copies row i of ``src`` addresses to row i of ``dst`` addresses. The tables
are numpy uint64 arrays; the call releases the GIL. ``copy_fragments`` gathers/scatters packed KV blocks
from a fragment table (kvtier.kernels builds it). When the native library is missing (a source tree that
was never built, a platform without a C compiler at install) the same copies run through ctypes.memmove,
one call per row, after one logged warning: slower for small rows, never wrong.

``CopyThreads`` (one per copy site: a tier's puts, its gets, a connection's) picks the threads of a batch by
measurement (``configured`` 0): each copy of a batch of
PARALLEL_MIN_BYTES or more is timed, and the next batch gets the thread count whose copies ran fastest here
lately (every choice measured by the first batches, the others re-measured every REPROBE_S): a second thread
pays where it gets a core of its own and the memory bus has room, and neither the core count nor the load
average says whether it does (docs/pool.md "Shared-memory copy threads" has the measurements).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvtier.envvars import ENV_NATIVE_CPU

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
# 1-4 MiB blocks on a quiet 2-core machine: the peer bench, docs/benchmarks.md "Benchmarks"); below it a batch is a few
# blocks and the second thread's start (~30-60 us) eats the gain, so it always gets one thread and is not timed.
PARALLEL_MIN_BYTES = 1 << 20
AUTO_MAX_THREADS = 2  # a third thread gains nothing where two already saturate the memory bus
# Whether a second thread pays changes with what else runs on the host: on 2 cores at load ~2.5 two threads
# copied at 1.6x one (11.5 vs 7.1 GB/s), at load 2-5 they also ran at 0.3-0.9x of one (commit 845df54). So the
# losing choice is timed again now and then: one batch every REPROBE_S costs little (a 16 MiB request copies in
# ~2 ms), a stale choice a lot.
REPROBE_S = 0.25
# ... and only after REPROBE_BATCHES batches of its size class went to the best since: a caller of a few big batches
# a second (an engine saving a prompt now and then, a benchmark's rounds) otherwise finds REPROBE_S passed at every
# batch and re-probes them all, copying half of each at the slower count's rate (0.8 of the best where one thread
# copies at 2/3 of two); with it, at most one batch in REPROBE_BATCHES + 1 is split for a re-probe.
REPROBE_BATCHES = 8
# ... and CLEAR_WIN_SPACING times as many where the best's median rate is CLEAR_WIN times the others' or more: a
# re-probe copies half a batch at the slower count's rate, and a one-sided put or get of 256 MiB (four 64 MiB
# batches) paid one nearly every other call (two threads 21-24 GB/s, one 15, in a put into the pool's file). A
# margin that wide is not closed by a small change on the host; a large one shows in the best's own rate (measured
# at every batch), and where that falls below the others' last rates they are picked again at once.
CLEAR_WIN = 1.25
CLEAR_WIN_SPACING = 4
RATE_WINDOW = 5  # a choice's rate is the median of its last RATE_WINDOW batches: one preempted copy moves nothing
# Batches each choice gets before the best is chosen: the very first copies into a pool's fresh file fault its
# pages in (0.5 GB/s where a warm copy runs 8-15), and one such sample must not decide.
PROBE_BATCHES = 3


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


_CORES = usable_cores()


def size_class(total_bytes: int) -> int:
    """The batch-size class a measured rate belongs to: 0 for [1, 4) MiB, 1 for [4, 16) MiB, 2 for [16, 64) MiB,
    3 from 64 MiB. A thread's start cost weighs on a small batch and not on a large one, so a rate measured on
    one class does not decide for another."""
    return min(3, max(0, (int(total_bytes).bit_length() - 21) // 2))


class CopyThreads:
    """The threads of each batched copy of one copy site (a connection's puts, its gets, a tier's copies).

    ``configured`` >= 1 fixes the count. 0 (auto): a batch under PARALLEL_MIN_BYTES gets one thread; a larger
    one gets the choice among 1..min(AUTO_MAX_THREADS, usable cores) threads with the best median rate measured
    for its size class, after every choice has been measured PROBE_BATCHES times (the first batches take the
    choices in turn; ``copy`` splits a big enough one between two choices), and a choice not measured for
    REPROBE_S, while REPROBE_BATCHES batches went to the best (CLEAR_WIN_SPACING times as many while the best
    wins by CLEAR_WIN or more), is measured again (one batch, or half of one; concurrent callers do not all probe).
    ``record`` takes the measurements, so a test feeds rates without timing anything. Thread-safe.
    """

    def __init__(self, configured: int = 0, *, choices: tuple[int, ...] | None = None, reprobe_s: float | None = None,
                 window: int = RATE_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        if configured < 0:
            raise ValueError(f"copy threads must be >= 0 (0: by measured rate), got {configured}")
        self.configured = configured
        self.choices = choices or tuple(range(1, min(AUTO_MAX_THREADS, _CORES) + 1))
        self._reprobe_s = REPROBE_S if reprobe_s is None else reprobe_s
        self._clock = clock
        self._rates: dict[tuple[int, int], deque[float]] = {}  # (size class, threads) -> recent rates, B/s
        self._tried: dict[tuple[int, int], float] = {}  # (size class, threads) -> when last picked or measured
        self._on_best: dict[int, int] = {}  # size class -> batches given the best count since its last re-probe
        self._window = window
        self._lock = threading.Lock()

    def pick(self, total_bytes: int) -> int:
        """The threads for a batch of ``total_bytes``."""
        return self._choose(total_bytes)[0]

    def _choose(self, total_bytes: int) -> tuple[int, int]:
        """(threads, partner): ``partner`` is 0 unless the batch is to measure ``threads`` (a probe, or the re-probe
        of a choice not measured for a while); then it is the count that copies the rest where ``copy`` splits
        the batch (while probing: the next least measured choice; after: the best)."""
        if self.configured:
            return self.configured, 0
        if total_bytes < PARALLEL_MIN_BYTES or len(self.choices) == 1:
            return 1, 0
        cls, now = size_class(total_bytes), self._clock()
        with self._lock:
            tried = {c: self._tried.get((cls, c), -float("inf")) for c in self.choices}
            counts = {c: len(self._rates.get((cls, c), ())) for c in self.choices}
            if min(counts.values()) < PROBE_BATCHES:  # probing: the least measured, the least recently tried first
                first, partner = sorted(self.choices, key=lambda c: (counts[c], tried[c]))[:2]
                self._tried[(cls, first)] = now
                return first, partner
            rates = {c: self.rate(c, total_bytes) for c in self.choices}
            best = max(self.choices, key=lambda c: rates[c])
            clear = all(rates[best] >= CLEAR_WIN * rates[c] for c in self.choices if c != best)
            if self._on_best.get(cls, 0) >= REPROBE_BATCHES * (CLEAR_WIN_SPACING if clear else 1):
                for c in self.choices:  # then one not measured for a while
                    if c != best and now - tried[c] >= self._reprobe_s:
                        self._tried[(cls, c)] = now  # claimed: a concurrent batch picks the best meanwhile
                        self._on_best[cls] = 0
                        return c, best
            self._on_best[cls] = self._on_best.get(cls, 0) + 1
            return best, 0

    def record(self, threads: int, total_bytes: int, seconds: float) -> None:
        """One batch of ``total_bytes`` copied on ``threads`` threads in ``seconds``."""
        if self.configured or total_bytes < PARALLEL_MIN_BYTES or seconds <= 0 or threads not in self.choices:
            return
        key = (size_class(total_bytes), threads)
        with self._lock:
            self._rates.setdefault(key, deque(maxlen=self._window)).append(total_bytes / seconds)
            self._tried[key] = self._clock()

    def rate(self, threads: int, total_bytes: int) -> float:
        """The median measured rate (B/s) of ``threads`` for batches of ``total_bytes``'s class; 0 if none."""
        got = self._rates.get((size_class(total_bytes), threads))
        return statistics.median(got) if got else 0.0

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray | int) -> int:
        """copy_rows on the picked threads, timed and recorded; returns the threads it picked.

        A batch that measures a choice (a probe or a re-probe) and whose two halves are each a batch of its size
        class is split: the first half on the choice measured, the second on the partner (the other choice
        while probing, the best after), each half timed and recorded. So a batch measures two choices, the
        probing is over in PROBE_BATCHES batches, not PROBE_BATCHES per choice (a caller copying a few big
        batches, an engine saving a prompt now and then, gets the best count from its fourth batch on), and a
        re-probe of the slower count costs half a batch at its rate, not a whole one."""
        n = len(dst)
        sizes = None if np.isscalar(nbytes) else np.ascontiguousarray(nbytes, np.uint64)
        total = n * int(nbytes) if sizes is None else int(np.sum(sizes, dtype=np.uint64))
        threads, partner = self._choose(total)
        half = n // 2
        first = half * int(nbytes) if sizes is None else int(np.sum(sizes[:half], dtype=np.uint64))
        parts = [(0, n, threads, total)]
        if partner and min(first, total - first) >= PARALLEL_MIN_BYTES and \
                size_class(first) == size_class(total - first) == size_class(total):
            parts = [(0, half, threads, first), (half, n, partner, total - first)]
        for a, b, count, part_bytes in parts:
            t0 = time.perf_counter()
            copy_rows(dst[a:b], src[a:b], nbytes if sizes is None else sizes[a:b], count)
            self.record(count, part_bytes, time.perf_counter() - t0)
        return threads


def copy_rows(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray | int, threads: int = 1) -> None:
    """dst[i] <- src[i] for nbytes[i] bytes on ``threads`` (>= 1) threads. All arrays uint64 and contiguous;
    rows must not overlap. Threads by measured rate: a CopyThreads of the copy site's own (its measurements are
    of that site's copies, not another tier's or connection's)."""
    if threads < 1:
        raise ValueError(f"copy_rows: threads must be >= 1, got {threads} (by measured rate: CopyThreads(0).copy)")
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
