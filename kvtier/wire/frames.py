"""Blocks <-> zmq frames: frames over runs of block rows, and block rows inside received frames.

A batch of blocks is a table of row addresses (uint64, one per block). To send it, consecutive rows (each
starting where the previous one ends) are coalesced into one frame that points straight at their memory
(zero-copy), so a contiguous batch of 64 KiB blocks costs a few large frames, not thousands of small ones.
Scattered small rows (a pool's slots after some churn, a DRAM tier's evictions) are gathered into reusable
staging buffers first: one native batched copy, far cheaper than a zmq message per 64 KiB block (measured
here: ~1 GB/s in 64 KiB frames against ~2 GB/s in 8 MiB frames over loopback). A receiver turns the frames
it got into row addresses and copies each row once, to where it belongs.

``views`` point into memory this module does not own: the caller keeps the owner alive (and unchanged) until
zmq is done with the frames (a MessageTracker says when), and then gives staging buffers back.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.memory.hostcopy import copy_rows

MAX_FRAME_BYTES = 8 << 20  # frames up to 8 MiB: the receiver's allocator reuses buffers this size (no page faults)
ZERO_COPY_RUN_BYTES = 1 << 20  # runs at least this long (on average) go zero-copy; shorter ones are gathered

_array_types: dict[int, type] = {}


def view(address: int, nbytes: int) -> Any:
    """A zero-copy buffer over ``nbytes`` at ``address`` (a ctypes array; pyzmq sends it with copy=False)."""
    t = _array_types.get(nbytes)
    if t is None:
        t = _array_types[nbytes] = ctypes.c_char * nbytes
    return t.from_address(address)


def runs(rows: np.ndarray, block_bytes: int, max_bytes: int = MAX_FRAME_BYTES) -> list[tuple[int, int]]:
    """(first row address, row count) of each run of consecutive rows, a run holding at most ``max_bytes``."""
    n = len(rows)
    if n == 0:
        return []
    rows = np.asarray(rows, dtype=np.uint64)
    per = max(1, max_bytes // block_bytes)
    breaks = np.flatnonzero(rows[1:] != rows[:-1] + np.uint64(block_bytes)) + 1
    out = []
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    for s, e in zip(starts, ends):
        for a in range(s, e, per):
            out.append((int(rows[a]), min(per, e - a)))
    return out


class Staging:
    """Reusable host buffers of ``nbytes`` for gathering scattered rows (allocated once, kept up to ``keep``).
    Thread-safe."""

    def __init__(self, nbytes: int = MAX_FRAME_BYTES, keep: int = 8) -> None:
        self.nbytes = nbytes
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = np.empty(self.nbytes, np.uint8)
        buf[:: 4096] = 0  # fault the pages in now, once, not on every send
        return buf

    def give(self, buffers: Sequence[np.ndarray]) -> None:
        with self._lock:
            self._free.extend(buffers[: max(0, self.keep - len(self._free))])


def frames_for(rows: np.ndarray, block_bytes: int, staging: Staging, threads: int = 1
               ) -> tuple[list[Any], list[np.ndarray]]:
    """Frames carrying ``rows`` in order, and the staging buffers they use (give them back once sent).

    Long runs are zero-copy views; when the runs average under ZERO_COPY_RUN_BYTES the rows are gathered
    into staging buffers (the caller may reuse ``rows``' memory as soon as this returns, for those)."""
    rows = np.asarray(rows, dtype=np.uint64)
    spans = runs(rows, block_bytes)
    if not spans or len(rows) * block_bytes >= ZERO_COPY_RUN_BYTES * len(spans) or block_bytes > staging.nbytes:
        return [view(addr, count * block_bytes) for addr, count in spans], []
    per = staging.nbytes // block_bytes
    frames, used = [], []
    for a in range(0, len(rows), per):
        part = rows[a : a + per]
        buf = staging.take()
        used.append(buf)
        base = np.uint64(buf.ctypes.data)
        copy_rows(base + np.arange(len(part), dtype=np.uint64) * np.uint64(block_bytes), part, block_bytes, threads)
        frames.append(memoryview(buf)[: len(part) * block_bytes])
    return frames, used


def should_gather(rows: np.ndarray, block_bytes: int) -> bool:
    """Whether ``rows`` are better sent gathered into one copy than as zero-copy frames: runs averaging under
    ZERO_COPY_RUN_BYTES (a zmq message per short run costs more than copying it)."""
    spans = runs(rows, block_bytes)
    return bool(spans) and len(rows) * block_bytes < ZERO_COPY_RUN_BYTES * len(spans)


def zero_copy(rows: np.ndarray, block_bytes: int) -> list[Any]:
    """Frames pointing straight at the rows (runs coalesced): the rows' owner keeps them until zmq is done."""
    return [view(addr, count * block_bytes) for addr, count in runs(rows, block_bytes)]


def gather(rows: np.ndarray, block_bytes: int, threads: int = 1) -> list[Any]:
    """The rows copied into one new buffer of exactly their size, as frames of at most MAX_FRAME_BYTES (the
    frames keep the buffer alive; nothing to give back)."""
    n = len(rows)
    buf = np.empty(n * block_bytes, np.uint8)
    base = np.uint64(buf.ctypes.data)
    copy_rows(base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes), np.asarray(rows, np.uint64),
              block_bytes, threads)
    per = max(1, MAX_FRAME_BYTES // block_bytes) * block_bytes
    mv = memoryview(buf)
    return [mv[a : a + per] for a in range(0, len(buf), per)]


def address(buf: Any) -> int:
    """Start address of a received frame (zmq.Frame, bytes or any buffer)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


def rows_in(frames: Sequence[Any], block_bytes: int) -> np.ndarray:
    """Row addresses of the blocks laid end to end in ``frames``; ValueError if a frame is not whole blocks."""
    parts = []
    for i, f in enumerate(frames):
        size = len(f)
        if size % block_bytes:
            raise ValueError(f"data frame {i} holds {size} bytes, not a whole number of {block_bytes}-byte blocks")
        if size:
            parts.append(np.uint64(address(f)) + np.arange(size // block_bytes, dtype=np.uint64)
                         * np.uint64(block_bytes))
    return np.concatenate(parts) if parts else np.empty(0, np.uint64)
