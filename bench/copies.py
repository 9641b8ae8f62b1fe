"""The best copy this host can do: the physical baseline of the rows that move host memory (the pool's shm rows).

np.copyto alone is one thread with glibc's stores; on this project's machines kvtier's streaming-store copy and a
second thread each beat it, so a ratio to np.copyto flatters whatever uses either. ``HostCopies`` times, in the
same round and on the same bytes (src -> out, both caller-owned):

  np.copyto            one thread, one memmove of the whole batch
  np.copyto 2 threads  the batch's two halves, one np.copyto each, on two threads (numpy releases the GIL)
  copy_rows 1 thread   kvtier.memory.hostcopy.copy_rows, one row per block, on one thread
  copy_rows 2 threads  the same on two threads

and the baseline of a round's figures is the fastest candidate's median (``best``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtier.bench.common import gbps, median, row
from kvtier.memory.hostcopy import copy_rows

CANDIDATES = ("np.copyto", "np.copyto 2 threads", "copy_rows 1 thread", "copy_rows 2 threads")


class HostCopies:
    """The candidate copies of ``src`` into ``out`` (same shape, (blocks, block bytes), uint8), timed a round at a
    time; every copy is checked to have moved the bytes."""

    def __init__(self, src: np.ndarray, out: np.ndarray) -> None:
        if src.shape != out.shape or src.ndim != 2:
            raise ValueError(f"HostCopies: src {src.shape} and out {out.shape} must be one (blocks, bytes) shape")
        self.src, self.out = src, out
        n, bb = src.shape
        step = np.arange(n, dtype=np.uint64) * np.uint64(bb)
        self._rows = (np.uint64(out.ctypes.data) + step, np.uint64(src.ctypes.data) + step, bb)
        self._other = ThreadPoolExecutor(1, thread_name_prefix="bench-copy")  # started once, like a pool's
        self.times: dict[str, list[float]] = {c: [] for c in CANDIDATES}

    def _copyto2(self) -> None:
        h = len(self.src) // 2
        if not h:
            np.copyto(self.out, self.src)
            return
        other = self._other.submit(np.copyto, self.out[h:], self.src[h:])
        np.copyto(self.out[:h], self.src[:h])
        other.result()

    def round(self, keep: bool = True) -> None:
        """Time every candidate once (kept unless ``keep`` is False: a warm-up round)."""
        dst, src, bb = self._rows
        for name, fn in (("np.copyto", lambda: np.copyto(self.out, self.src)),
                         ("np.copyto 2 threads", self._copyto2),
                         ("copy_rows 1 thread", lambda: copy_rows(dst, src, bb, 1)),
                         ("copy_rows 2 threads", lambda: copy_rows(dst, src, bb, 2))):
            self.out[:, :8] = 0
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if not np.array_equal(self.out[:, :8], self.src[:, :8]):
                raise RuntimeError(f"bench copy baseline: {name} did not copy the batch")
            if keep:
                self.times[name].append(dt)

    def figures(self) -> dict[str, float]:
        """GB/s of each candidate: the median of its kept rounds."""
        return {c: gbps(self.src.nbytes, median(t)) for c, t in self.times.items() if t}

    def best(self) -> tuple[str, float]:
        """The fastest candidate and its GB/s: the baseline."""
        fig = self.figures()
        name = max(fig, key=lambda c: fig[c])
        return name, fig[name]

    def rows(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        """One row per candidate (``path`` "copy: <candidate>"), each beside the best."""
        _, top = self.best()
        return [row({**fields, "path": f"copy: {c}", "op": "copy"}, g, top) for c, g in self.figures().items()]

    def close(self) -> None:
        self._other.shutdown()

    def __enter__(self) -> HostCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CANDIDATES", "HostCopies"]
