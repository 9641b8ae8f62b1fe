"""``kvtier bench tiers --tier ssd``: the SSD tier's batch put/get GB/s beside raw O_DIRECT I/O of the same bytes.

Each round: raw write (the same bytes, O_DIRECT, ``io_threads`` threads each writing whole blocks at
sequential offsets of one preallocated file, then fdatasync), the tier's put of one batch (data + fdatasync +
index commit, i.e. durable), raw read (O_DIRECT back into aligned memory), the tier's get (O_DIRECT, checksums
verified), then a bit-exact check and a remove so the next round reuses the same slots. Round 0 warms up
(allocates the files' extents); figures are medians of the other rounds. Reads are real device reads: both
sides use O_DIRECT, and the run refuses to report a filesystem without it as a device figure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.common import gbps, median, row, time_once
from kvtier.config import Config
from kvtier.keys import Namespace
from kvtier.pins import PinTable
from kvtier.tiers.ssd import DiskTier
from kvtier.tiers.ssd.io import aligned_blocks, probe_direct_io, raw_view

DEFAULT_SIZES = "1MiB,4MiB"


def bench_ssd(sizes: list[int], total: int, rounds: int, *, path: str | None = None,
              io_threads: int = Config.ssd_io_threads, **_: Any) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-ssd-", dir=path or "/var/tmp"))
    try:
        reason = probe_direct_io(root)
        if reason:
            raise OSError(f"{root} cannot do O_DIRECT ({reason}): reads would come from the page cache, not the "
                          "device; pass --path on a real disk")
        print(f"SSD bench in {root} ({_filesystem(root)}), {io_threads} I/O threads")
        rows = []
        with ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-bench-raw") as pool:
            for bb in sizes:
                rows += _bench_size(root, bb, max(1, total // bb), rounds, io_threads, pool)
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _bench_size(root: Path, bb: int, n: int, rounds: int, io_threads: int, pool: ThreadPoolExecutor
                ) -> list[dict[str, Any]]:
    nbytes = n * bb
    src = aligned_blocks(n, bb)
    src.copy_(torch.arange(nbytes, dtype=torch.int32).to(torch.uint8).view(n, bb))  # not constant: catches mixups
    src[:, :8] = torch.arange(n, dtype=torch.int64).view(n, 1).view(torch.uint8)  # every block distinct
    out = aligned_blocks(n, bb)
    tier = DiskTier(root / f"tier-{bb}", nbytes, bb, io_threads=io_threads, staging_bytes=0)
    tier.attach(PinTable(), None)
    raw = _RawFile(root / f"raw-{bb}.dat", nbytes, bb, pool)
    ns = Namespace("bench-ssd")
    times: dict[str, list[float]] = {"raw_write": [], "put": [], "raw_read": [], "get": []}
    try:
        for r in range(rounds + 1):
            keys = ns.keys(range(r * n, (r + 1) * n))
            step: dict[str, Callable[[], Any]] = {
                "raw_write": lambda: raw.write(src), "put": lambda: tier.put(keys, src),
                "raw_read": lambda: raw.read(out), "get": lambda: tier.get(keys, out)}
            for name in ("raw_write", "put", "raw_read"):
                t = time_once(step[name])
                if r:
                    times[name].append(t)
            out.zero_()
            t = time_once(step["get"])
            if not torch.equal(out, src):
                raise RuntimeError(f"ssd bench: bytes read back differ from bytes written at {bb} B blocks")
            if r:
                times["get"].append(t)
            tier.remove(keys)
    finally:
        tier.close()
        raw.close()
    return [row({"tier": "ssd", "op": "put", "block_bytes": bb}, gbps(nbytes, median(times["put"])),
                gbps(nbytes, median(times["raw_write"]))),
            row({"tier": "ssd", "op": "get", "block_bytes": bb}, gbps(nbytes, median(times["get"])),
                gbps(nbytes, median(times["raw_read"])))]


class _RawFile:
    """The physical baseline: one preallocated file, O_DIRECT, whole blocks at sequential offsets."""

    def __init__(self, path: Path, nbytes: int, bb: int, pool: ThreadPoolExecutor) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.bb, self.n, self.pool = bb, nbytes // bb, pool

    def write(self, src: torch.Tensor) -> None:
        base = src.data_ptr()
        list(self.pool.map(lambda i: os.pwritev(self.fd, [raw_view(base + i * self.bb, self.bb)], i * self.bb),
                           range(self.n)))
        os.fdatasync(self.fd)

    def read(self, out: torch.Tensor) -> None:
        base = out.data_ptr()
        list(self.pool.map(lambda i: os.preadv(self.fd, [raw_view(base + i * self.bb, self.bb)], i * self.bb),
                           range(self.n)))

    def close(self) -> None:
        os.close(self.fd)


def _filesystem(path: Path) -> str:
    """The filesystem type and device holding ``path``, from /proc/self/mounts (longest mount point wins)."""
    best = ("", "?", "?")
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]}"

