"""The I/O half of the SSD tier: segment files, aligned host memory, O_DIRECT. No index, no policy.

A DiskTier directory holds ``seg-00000.dat``, ``seg-00001.dat``, ...; segment i holds slots
[i * per_segment, (i + 1) * per_segment) of ``slot_bytes`` each, so a block's place on disk is a pure function
of its slot number. A segment file is created on first use and its whole length reserved with posix_fallocate,
so a full disk fails there, before any block is half written.

O_DIRECT moves bytes between host memory and the device without the page cache (reads are real device reads,
writes do not evict the engine's page cache), but buffer addresses, file offsets and lengths must be multiples
of ``ALIGN``. Filesystems without it (ramfs, some FUSE and older tmpfs) are detected by ``probe_direct_io``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.tiers.slots import SlotAllocator

log = logging.getLogger(__name__)

ALIGN = 4096  # safe for every device (512 B and 4 KiB logical sectors); also the page size
# Longest a put (SSD) or a waiting submit (pool write-behind) waits for StagingPool memory before it gives up on
# those blocks; one value for both, next to the StagingPool they wait on.
STAGE_TIMEOUT_S = 10.0
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_SEGMENT_NAME = re.compile(r"^seg-(\d+)\.dat$")


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-aligned, zero-filled anonymous memory as a uint8 array (kept alive by the array)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def aligned_blocks(count: int, block_bytes: int) -> torch.Tensor:
    """A ``count x block_bytes`` uint8 tensor at a page-aligned address: blocks read from the SSD tier into
    it land with no bounce copy when ``block_bytes`` is a multiple of ALIGN."""
    return torch.from_numpy(aligned_empty(count * block_bytes)).view(count, block_bytes)


def raw_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``address``; the caller keeps the owning object alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address))


def probe_direct_io(directory: Path) -> str:
    """Return "" when ``directory``'s filesystem takes aligned O_DIRECT writes and reads, else the reason."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = directory / ".direct-io-probe"
    buf = aligned_empty(ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return f"open with O_DIRECT failed: {e.strerror}"
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return ""
    except OSError as e:
        return f"an aligned O_DIRECT write/read failed: {e.strerror}"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


class StagingPool:
    """Aligned host memory in fixed-size chunks, for bytes on their way to disk (write-behind copies, bounce
    buffers for unaligned sources). Thread-safe; ``alloc`` may wait for chunks to come back."""

    def __init__(self, chunk_bytes: int, count: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.count = count
        self._memory = aligned_empty(chunk_bytes * count)
        self._base = int(self._memory.ctypes.data)
        self._alloc = SlotAllocator(count)
        self._cv = threading.Condition()

    def alloc(self, n: int, *, wait: bool, timeout: float | None = None) -> list[int]:
        """Up to ``n`` chunks. With ``wait``, blocks until at least one is free (or ``timeout`` passes)."""
        with self._cv:
            if wait and self._alloc.free_count == 0:
                self._cv.wait_for(lambda: self._alloc.free_count > 0, timeout)
            return self._alloc.alloc(n)

    def free(self, chunks: Sequence[int]) -> None:
        if chunks:
            with self._cv:
                self._alloc.free(chunks)
                self._cv.notify_all()

    def addresses(self, chunks: Sequence[int]) -> np.ndarray:
        return np.uint64(self._base) + np.asarray(chunks, dtype=np.uint64) * np.uint64(self.chunk_bytes)

    @property
    def in_use(self) -> int:
        return self._alloc.used_count


class SegmentFiles:
    """The data files of one DiskTier directory. Thread-safe: positional I/O on shared descriptors.

    Owns its file descriptors; buffers passed to ``write``/``read`` belong to the caller for the call only.
    I/O errors surface as OSError with the file named; nothing here decides what a failure means.
    """

    def __init__(self, root: Path, slot_bytes: int, per_segment: int, num_slots: int, direct: bool) -> None:
        self.root = root
        self.slot_bytes = slot_bytes
        self.per_segment = per_segment
        self.num_slots = num_slots
        self.num_segments = -(-num_slots // per_segment)
        self.direct = direct
        self._flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        self._fds: dict[int, int] = {}
        self._ready: set[int] = set()  # segments whose full length is reserved
        self._lock = threading.Lock()

    def path(self, segment: int) -> Path:
        return self.root / f"seg-{segment:05d}.dat"

    def length(self, segment: int) -> int:
        """Bytes of ``segment``'s file: its slots (the last segment may hold fewer)."""
        return min(self.per_segment, self.num_slots - segment * self.per_segment) * self.slot_bytes

    def place(self, slot: int) -> tuple[int, int]:
        """(segment, byte offset in its file) of ``slot``."""
        return slot // self.per_segment, (slot % self.per_segment) * self.slot_bytes

    def scan(self) -> dict[int, int]:
        """Segment files present now: segment -> file size. Files past ``num_segments`` (the capacity shrank)
        are deleted, so the bytes on disk never exceed the capacity."""
        sizes = {}
        for p in self.root.iterdir():
            m = _SEGMENT_NAME.match(p.name)
            if not m:
                continue
            seg = int(m.group(1))
            if seg >= self.num_segments:
                log.info("SSD tier: removing %s (beyond the configured capacity)", p)
                p.unlink(missing_ok=True)
                continue
            size = p.stat().st_size
            if size > self.length(seg):  # the last segment got shorter: drop the tail past the capacity
                os.truncate(p, self.length(seg))
                size = self.length(seg)
            sizes[seg] = size
        return sizes

    def remove_all(self) -> None:
        with self._lock:
            self._close_fds()
            for p in self.root.glob("seg-*.dat"):
                p.unlink(missing_ok=True)

    def write(self, slot: int, buffers: Sequence[memoryview]) -> None:
        """Write consecutive slots starting at ``slot`` (all in one segment) from ``buffers``."""
        seg, offset = self.place(slot)
        fd = self._reserved_fd(seg)
        try:
            _pwritev_all(fd, list(buffers), offset)
        except OSError as e:
            raise OSError(e.errno, f"writing {len(buffers)} slots at offset {offset} of {self.path(seg)}: "
                                   f"{e.strerror}") from None

    def read(self, slot: int, buffers: Sequence[memoryview]) -> int:
        """Read consecutive slots into ``buffers``; return the bytes read (short when the file was truncated)."""
        seg, offset = self.place(slot)
        try:
            fd = self._fd(seg, create=False)
            return _preadv_all(fd, list(buffers), offset)
        except OSError as e:
            raise OSError(e.errno, f"reading {len(buffers)} slots at offset {offset} of {self.path(seg)}: "
                                   f"{e.strerror}") from None

    def sync(self, segments: Sequence[int]) -> None:
        """fdatasync ``segments``: the written bytes (and their extents' metadata) reach stable storage."""
        for seg in segments:
            try:
                os.fdatasync(self._fd(seg, create=False))
            except OSError as e:
                raise OSError(e.errno, f"fdatasync of {self.path(seg)}: {e.strerror}") from None

    def unlinked(self, segment: int) -> bool:
        """True when ``segment``'s open file was deleted or replaced under us (its blocks must not be trusted
        to survive a restart, so the tier drops them)."""
        with self._lock:
            fd = self._fds.get(segment)
        if fd is None:
            return False
        try:
            st = os.stat(self.path(segment))
        except FileNotFoundError:
            return True
        return st.st_ino != os.fstat(fd).st_ino

    def forget(self, segment: int) -> None:
        """Close ``segment``'s descriptor; the next write recreates (and re-reserves) the file."""
        with self._lock:
            fd = self._fds.pop(segment, None)
            self._ready.discard(segment)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._close_fds()

    # ---- internals ---------------------------------------------------------------------------------------

    def _fd(self, seg: int, *, create: bool) -> int:
        with self._lock:
            fd = self._fds.get(seg)
            if fd is None:
                flags = self._flags if create else self._flags & ~os.O_CREAT
                fd = os.open(self.path(seg), flags, 0o600)
                self._fds[seg] = fd
            return fd

    def _reserved_fd(self, seg: int) -> int:
        fd = self._fd(seg, create=True)
        if seg not in self._ready:
            with self._lock:
                if seg not in self._ready:
                    length = self.length(seg)
                    if os.fstat(fd).st_size < length:
                        try:
                            os.posix_fallocate(fd, 0, length)
                        except OSError as e:
                            raise OSError(e.errno, f"reserving {length} bytes for {self.path(seg)}: "
                                                   f"{e.strerror}") from None
                    self._ready.add(seg)
        return fd

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._ready.clear()


def _pwritev_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    while buffers:
        batch = buffers[:IOV_MAX]
        n = os.pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(errno.EIO, "the device accepted no bytes")
        offset += n
        buffers = _advance(buffers, n)


def _preadv_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    total = 0
    while buffers:
        n = os.preadv(fd, buffers[:IOV_MAX], offset)
        if n == 0:  # end of file: the segment was truncated
            break
        total += n
        offset += n
        buffers = _advance(buffers, n)
    return total


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers (after a short or batched vectored I/O)."""
    i = 0
    while i < len(buffers) and n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def lock_directory(path: Path) -> int:
    """Hold ``path/LOCK`` exclusively for the tier's lifetime: two stores on one directory would overwrite
    each other's slots. The kernel drops the lock when the process dies, kill -9 included."""
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(f"SSD directory {path} is in use by another store (its LOCK is held)") from None
    return fd


class DirectoryInUse(OSError):
    """Another DiskTier (in this or another process) has the directory open."""
