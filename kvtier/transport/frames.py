"""Blocks <-> zmq frames without copies: frames over runs of block rows, and block rows inside received frames.

A batch of blocks is a table of row addresses (uint64, one per block). To send it, consecutive rows (each
starting where the previous one ends) are coalesced into one frame that points straight at their memory,
so a contiguous batch of 64 KiB blocks costs a few large frames, not thousands of small ones. A receiver
turns the frames it got back into row addresses and copies each row once, to where it belongs.

``views`` point into memory this module does not own: the caller keeps the owner alive (and unchanged) until
zmq is done with the frames (a MessageTracker says when).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_FRAME_BYTES = 8 << 20  # frames up to 8 MiB: the receiver's allocator reuses buffers this size (no page faults)

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


def views(rows: np.ndarray, block_bytes: int, max_bytes: int = MAX_FRAME_BYTES) -> list[Any]:
    """Zero-copy frames covering ``rows`` in order."""
    return [view(addr, count * block_bytes) for addr, count in runs(rows, block_bytes, max_bytes)]


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
