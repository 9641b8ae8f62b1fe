"""SlotGenerations: one counter per DRAM slot of the pool, bumped whenever the slot is handed to a new key or
goes free.

Why: a one-sided reader (shm, rdma) copies a block out of the pool's memory itself, outside the pool's
process; its acquire lease keeps the slot from being reused, but a reader can outlive its lease (a stalled
process) and a lease can be ended early (a client bug). So the acquire reply names each slot's generation,
the reader copies, then reads the generations again: where one changed, the slot was given to another key
while it copied and those bytes count as a miss. A slot's generation is bumped when it is reserved for a
key, before anyone is told where to write (the pool's own copy, a stream receive, or a one-sided writer's
reserve reply), so a reader that saw any byte of the new key's data sees the new generation after it. It is
bumped again when the slot goes free (its key removed or evicted, a write failed): a client that reads a block
where it saw it last, with no acquire (kvtier/transport/locations.py), needs an unchanged generation to mean
"still this key's", not only "no other key's yet".

Ordering (x86-64, where kvtier's native copies run): loads are not reordered with other loads, so a reader's
generation load after its copy's loads sees a bump that happened before a write it read; the pool follows
each bump with a locked instruction (a lock round trip) so the bump is visible before its own non-temporal
copy stores.

When the pool serves shared memory, the counters live in a file next to the DRAM file (``<dram file>.gen``,
0600, mapped read-only by clients); otherwise in private memory (RDMA clients read them through a second
registered region). Thread-safe: distinct slots are bumped by distinct reservations.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_fence = threading.Lock()


class SlotGenerations:
    """``num_slots`` uint64 counters, all one random value at start (never 0, which means "no slot"): a pool's
    generations are its own, so a generation a client remembers from a pool's earlier life matches none of a
    restarted pool's (an RDMA client, which cannot see the restart before a reply, reads them there)."""

    def __init__(self, num_slots: int, path: Path | None = None) -> None:
        self.num_slots = num_slots
        self.nbytes = num_slots * 8
        self.path = path
        self._mm: mmap.mmap | None = None
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, self.nbytes)
                self._mm = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._gen = np.frombuffer(self._mm, dtype=np.uint64)
        else:
            self._gen = np.zeros(num_slots, dtype=np.uint64)
        self._gen[:] = secrets.randbits(62) | 1
        self.address = int(self._gen.ctypes.data)

    def bump(self, slots: Sequence[int] | np.ndarray) -> None:
        """The slots go to new keys: call before anyone may write into them."""
        if len(slots):
            self._gen[np.asarray(slots, dtype=np.int64)] += np.uint64(1)
            with _fence:  # a locked instruction: the bumps are visible before the stores that follow
                pass

    def of(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        return self._gen[np.asarray(slots, dtype=np.int64)].copy()

    def close(self) -> None:
        self._gen = np.zeros(0, dtype=np.uint64)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still exported (an RDMA registration being torn down): the OS frees it
                pass
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class GenerationView:
    """A client's read-only mapping of a pool's generation file (shm transport), from an fd the caller opened
    (and checked: kvtier/transport/shm.py maps only a file the pool's own uid owns) and still owns."""

    def __init__(self, fd: int, name: str, num_slots: int) -> None:
        if os.fstat(fd).st_size < num_slots * 8:
            raise ValueError(f"{name}: smaller than {num_slots} slot generations")
        self._mm = mmap.mmap(fd, num_slots * 8, mmap.MAP_SHARED, mmap.PROT_READ)
        self._gen = np.frombuffer(self._mm, dtype=np.uint64)
        self.num_slots = num_slots

    def of(self, slots: np.ndarray) -> np.ndarray:
        return self._gen[slots].copy()
