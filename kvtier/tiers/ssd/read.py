"""The SSD tier's read path: a batch's blocks read in parallel, each verified before it counts as a hit.

Consecutive slots of one segment become one preadv (vectored into the caller's rows when they are aligned for
O_DIRECT), spread over the tier's I/O threads, so a prefix's reads are all in flight together. A row that
is not aligned goes through a per-thread aligned bounce buffer and is copied out only after it verified.
Called by DiskTier.get with the slots marked busy (they cannot be reused during the reads); it needs only the
tier's SlotDevice (files, I/O threads, sizes), none of its bookkeeping.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from concurrent.futures import wait
from dataclasses import dataclass

import numpy as np

from kvtier.tiers.ssd.index import block_checksum
from kvtier.tiers.ssd.io import aligned_empty, raw_view
from kvtier.tiers.ssd.slots import SlotDevice

RUN_BYTES = 8 << 20  # one I/O call moves at most this much: enough to stream, small enough to spread

_bounce = threading.local()


@dataclass(frozen=True)
class ReadFailure:
    """A block that must be a miss: ``reason`` is the counter it goes to (checksum_failures, read_errors,
    short_reads, segment_file_gone); ``error`` the OSError if the read itself failed."""

    index: int  # position in the get batch (-1 when not from a batch)
    slot: int
    reason: str
    error: OSError | None = None
    key: bytes | None = None


@dataclass
class _Run:
    """Reads of consecutive slots of one segment; ``direct`` runs land in the caller's rows (one preadv),
    the others hold one block read through a bounce buffer."""

    direct: bool
    reads: list[tuple[int, int, int]]  # (batch index, slot, checksum)


def read_slots(dev: SlotDevice, keys: Sequence[bytes], ptrs: np.ndarray, reads: Sequence[tuple[int, int, int]]
               ) -> list[ReadFailure]:
    """Read ``reads`` = (batch index, slot, checksum) into the rows at ``ptrs``; return the failures."""
    max_run = max(1, RUN_BYTES // dev.slot_bytes)
    place = dev.files.place
    runs: list[_Run] = []
    for r in sorted(reads, key=lambda r: r[1]):
        direct = dev.lands_direct(int(ptrs[r[0]]))
        last = runs[-1] if runs else None
        if (last is not None and direct and last.direct and r[1] == last.reads[-1][1] + 1
                and len(last.reads) < max_run and place(r[1])[0] == place(last.reads[0][1])[0]):
            last.reads.append(r)
        else:
            runs.append(_Run(direct, [r]))
    futures = dev.io.run_each(_read_run, [(dev, keys, ptrs, run) for run in runs])
    wait(futures)  # every read has finished with the caller's rows before we return (or raise)
    failures: list[ReadFailure] = []
    for f in futures:
        failures += f.result()
    return failures


def _read_run(dev: SlotDevice, keys: Sequence[bytes], ptrs: np.ndarray, run: _Run) -> list[ReadFailure]:
    bb, sb = dev.block_bytes, dev.slot_bytes
    if not run.direct:
        i, slot, checksum = run.reads[0]
        return _read_bounced(dev, keys[i], i, slot, checksum, int(ptrs[i]))
    views = [raw_view(int(ptrs[i]), sb) for i, _, _ in run.reads]
    try:
        got = dev.files.read(run.reads[0][1], views)
    except OSError as e:
        if len(run.reads) > 1:  # find which blocks are bad: the others are still good data
            return [f for r in run.reads for f in _read_run(dev, keys, ptrs, _Run(True, [r]))]
        i, slot, _ = run.reads[0]
        ctypes.memset(int(ptrs[i]), 0, bb)
        return [ReadFailure(i, slot, "read_errors", e)]
    failures = []
    for j, (i, slot, checksum) in enumerate(run.reads):
        if got < (j + 1) * sb:
            reason = "short_reads"  # the segment file was truncated
        elif block_checksum(views[j][:bb], keys[i]) != checksum:
            reason = "checksum_failures"
        else:
            continue
        ctypes.memset(int(ptrs[i]), 0, bb)  # the caller must not mistake these bytes for the block
        failures.append(ReadFailure(i, slot, reason))
    return failures


def _read_bounced(dev: SlotDevice, key: bytes, i: int, slot: int, checksum: int, dst: int) -> list[ReadFailure]:
    bufs = getattr(_bounce, "bufs", None)
    if bufs is None:
        bufs = _bounce.bufs = {}
    buf = bufs.get(dev.slot_bytes)
    if buf is None:
        buf = bufs[dev.slot_bytes] = aligned_empty(dev.slot_bytes)
    view = raw_view(int(buf.ctypes.data), dev.slot_bytes)
    try:
        got = dev.files.read(slot, [view])
    except OSError as e:
        return [ReadFailure(i, slot, "read_errors", e)]
    if got < dev.slot_bytes:
        return [ReadFailure(i, slot, "short_reads")]
    if block_checksum(view[: dev.block_bytes], key) != checksum:
        return [ReadFailure(i, slot, "checksum_failures")]
    ctypes.memmove(dst, int(buf.ctypes.data), dev.block_bytes)
    return []
