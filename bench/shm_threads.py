"""Where two copy threads start to beat one: ``python -m kvtier.bench.shm_threads``.

The copy the pool's shared-memory transport makes (kvtier.transport.shm): a batch of blocks between this
process's buffer and a file mapped from /dev/shm, one native ``copy_rows`` call, on 1 and on 2 threads, per
block size and batch size, beside np.copyto of the same bytes in the same round (the physical baseline). Rounds
interleave the three so machine noise hits all alike; figures are medians. kvtier.memory.hostcopy.PARALLEL_MIN_BYTES
is the smallest batch where the 2-thread column wins.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

import numpy as np

from kvtier.memory.hostcopy import copy_rows

BLOCKS = (64 << 10, 1 << 20, 4 << 20)
BATCHES = (64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20)


def _time(fn: object, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--bytes-per-round", type=int, default=256 << 20, help="bytes each timing moves (repeats)")
    args = p.parse_args()
    size = max(BATCHES)
    fd, path = tempfile.mkstemp(prefix=f"kvtier-shm-threads-{os.getpid()}-", dir="/dev/shm")
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        shm = np.frombuffer(mm, np.uint8)
        buf = np.ones(size, np.uint8)
        shm[:] = 2  # prefault both
        print("write (buffer -> shm file) GB/s, medians; ratio = 2 threads / 1 thread")
        print(f"{'block':>8} {'batch':>8} {'memcpy':>8} {'1 thread':>9} {'2 threads':>10} {'ratio':>6}")
        for bb in BLOCKS:
            for total in BATCHES:
                if total < bb:
                    continue
                n = total // bb
                dst = np.uint64(shm.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(bb)
                src = np.uint64(buf.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(bb)
                reps = max(1, args.bytes_per_round // total)
                t: dict[str, list[float]] = {"memcpy": [], "1": [], "2": []}
                for _ in range(args.rounds):
                    t["memcpy"].append(_time(lambda: np.copyto(shm[:total], buf[:total]), reps))
                    t["1"].append(_time(lambda: copy_rows(dst, src, bb, 1), reps))
                    t["2"].append(_time(lambda: copy_rows(dst, src, bb, 2), reps))
                g = {k: total / float(np.median(v)) / 1e9 for k, v in t.items()}
                print(f"{bb >> 10:>6}Ki {total >> 10:>6}Ki {g['memcpy']:>8.2f} {g['1']:>9.2f} {g['2']:>10.2f} "
                      f"{g['2'] / g['1']:>6.2f}", flush=True)
        del shm
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
