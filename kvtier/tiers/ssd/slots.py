"""The SSD tier's shared state: the slot bookkeeping (``DiskSlots``) and what moves a block (``SlotDevice``).

DiskTier owns one of each and hands them to the parts it composes: ``DiskWriter`` (write.py) writes
batches and updates the index, ``WriteBehind`` (writebehind.py) stages blocks, ``read_slots`` (read.py)
reads them. So the state that reads, writes and removals share is declared once, here, and each part names
what it uses.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.iothreads import IoThreads
from kvtier.policies import Clock
from kvtier.tiers.base import EvictListener, TierStats
from kvtier.tiers.slots import SlotTable
from kvtier.tiers.ssd.io import ALIGN, SegmentFiles

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SlotDevice:
    """Where a slot's bytes live and the threads that move them: the segment files, the tier's I/O pool and the
    sizes. Immutable; thread-safe (positional I/O on shared descriptors). Owned by DiskTier, which closes the
    files and shuts the pool down."""

    files: SegmentFiles
    io: IoThreads
    block_bytes: int
    slot_bytes: int  # block_bytes rounded up to ALIGN with O_DIRECT, else block_bytes
    direct: bool  # O_DIRECT: sources and destinations must be ALIGN-aligned and slot-sized

    def lands_direct(self, address: int) -> bool:
        """Whether a block can move between ``address`` and its slot with no bounce buffer."""
        return self.slot_bytes == self.block_bytes and (not self.direct or address % ALIGN == 0)


class DiskSlots(SlotTable):
    """Which key holds which slot, and the state around it, for one DiskTier (in the engine process): the
    SlotTable both tiers share (slots.py: reserve, publish, drop, eviction and admission rules; no leaving
    state, the SSD has nothing below it), plus what only the SSD has: ``staged``, checksums, the index's write
    sequence, the stop flag and its counters.

    Lock discipline: every field is read and changed under ``lock``, which is never held across I/O (a read,
    a write, an fsync or an index transaction) nor across a call to ``on_evict``. One exception:
    ``DiskTier.contains`` tests membership of ``slot_of`` and ``staged`` without it (a dict lookup is atomic
    under the GIL; the answer may be stale by the time the caller uses it, as with the lock).

    A slot is in exactly one of: free (in ``alloc``), ``pending`` (reserved by a write in flight), committed
    (``slot_of``, its bytes and index entry durable, ``checksum`` set), or doomed (dropped but still busy:
    ``busy`` counts reads and writes in flight on it and removals whose index entry is not yet deleted, which
    ``drop(hold=True)`` adds; a doomed slot goes back to ``alloc`` when it is idle, ``free_idle_doomed``).
    ``staged`` keys have no slot: they sit in staging memory (at the address given) until write-behind commits
    them.
    """

    def __init__(self, name: str, num_slots: int, capacity_bytes: int, block_bytes: int, policy: str,
                 clock: Clock | None, where: Path) -> None:
        # Admission as DRAM's: a full SSD's policy declines blocks not worth evicting what it predicts is
        # needed sooner (a block DRAM declined reaches here by the offload's rule, then this one decides).
        super().__init__(num_slots, policy, clock, stats=TierStats(name, capacity_bytes, 0, 0),
                         block_bytes=block_bytes, where="SSD tier", admission="enforce")
        self.lock = threading.Lock()
        self.staged: dict[bytes, int] = {}  # key -> staging address: queued for write-behind, readable
        self.checksum = np.zeros(num_slots, dtype=np.uint64)
        self.seq = 0  # the next index entry's write sequence number (restore order = eviction order)
        self.on_evict: EvictListener | None = None
        self.counts: Counter[str] = Counter()
        self.stopped = ""  # why the tier stopped admitting; "" while it admits
        self._dir = where  # (SlotTable's own _where is its log label)

    def held_or_pending(self, key: bytes) -> bool:
        """Committed, or being written now (lock held): what write-behind does not stage again."""
        return key in self.slot_of or key in self.pending

    def stop_admitting(self, err: OSError, what: str) -> None:
        """Refuse new blocks from now on (the disk is full or failing); logged once, reason in stats. Takes the
        lock."""
        with self.lock:
            first = not self.stopped
            if first:
                self.stopped = f"{errno.errorcode.get(err.errno or 0, err.errno)} on {what}: {err.strerror}"
        if first:
            log.error("SSD tier at %s stopped admitting blocks after %s; it keeps serving the blocks it holds "
                      "and the store keeps serving from DRAM. Cause: %s", self._dir, what, err)

    def report_gone(self, keys: list[bytes]) -> None:
        """Tell the store's eviction listener that ``keys`` are no longer held (evicted, or dropped as damaged):
        it emits their "removed" events, which keep the master and the engines' KV events honest. Lock not
        held (the listener may call back into the store)."""
        if keys and self.on_evict is not None:
            try:
                self.on_evict(keys, [])
            except Exception:
                log.exception("SSD eviction listener failed for %d blocks", len(keys))
