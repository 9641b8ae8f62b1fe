"""DiskTier: the SSD tier. Fixed-size block slots in segment files, an lmdb index, a checksum on every read.

Runs in the engine process (embedded mode), under DRAM in a TieredStore. Thread-safe: metadata changes under one
lock; reads and writes run outside it on a pool of I/O threads doing preadv/pwritev (which release the GIL), so
a batch's blocks move in parallel. Blocks all have one size, so space is managed per block: a block's slot is
freed the moment it is evicted or removed and reused by the next write; the eviction policy (lru, s3fifo, ...)
is the same pluggable one the DRAM tier uses (why not log-structured segments with reinsertion: write.py).

Durability and crash safety (kill -9 or power loss at any moment never serves wrong bytes):
  * a block's entry is committed to the index only after its bytes are written and fdatasync'ed;
  * an entry is deleted (committed) before its slot is reused, and a removed slot is held until then;
  * every entry carries an xxh3-64 checksum of the bytes seeded with the key, verified on every read: a
    torn, stale, misdirected or corrupted block is a miss, dropped from the index and counted, never data.
Warm restart: reopening the directory validates each entry against the segment files (missing or truncated
file, slot beyond the capacity, other layout) and serves the rest.

Faults: ENOSPC or EIO on a write (or EIO on a read) stops admission, logs once and names the cause in
``stats().extra["stopped_reason"]``; the tier keeps serving verified reads and the store keeps serving DRAM.

Buffer ownership: ``put`` writes from the caller's blocks (directly when they are aligned for O_DIRECT, else
through an aligned bounce copy) and returns when they are durable; ``get`` reads into the caller's ``out``
(directly when aligned, else through a bounce buffer); ``put_later`` copies the blocks into staging memory
before it returns and writes them in the background (writebehind.py's WriteBehind, with this tier's hooks).

Composition: DiskTier owns the slot bookkeeping (``DiskSlots``) and the files and I/O threads (``SlotDevice``),
both in slots.py, and hands them to the ``DiskWriter`` (writes, index updates, write.py) and
``WriteBehind`` (writebehind.py) it composes and to ``read_slots`` (read.py).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash

from kvtier.blocks import block_rows
from kvtier.memory.hostcopy import copy_rows
from kvtier.iothreads import IoThreads
from kvtier.pins import PinTable
from kvtier.policies import Clock, Observations
from kvtier.policies.guard import GuardedPolicy
from kvtier.private import private_dir
from kvtier.tiers.base import EvictListener, ListsKeys, TierStats, WriteBehindStaging
from kvtier.tiers.ssd.index import DiskIndex, IndexFault
from kvtier.tiers.ssd.io import (ALIGN, DirectoryInUse, SegmentFiles, StagingPool, lock_directory,
                                 probe_direct_io, round_up)
from kvtier.tiers.ssd.read import ReadFailure, read_slots
from kvtier.tiers.ssd.restore import restore_index
from kvtier.tiers.ssd.slots import DiskSlots, SlotDevice
from kvtier.tiers.ssd.write import DiskWriter
from kvtier.tiers.writebehind import Event, WriteBehind

log = logging.getLogger(__name__)


class DiskTier(WriteBehindStaging, ListsKeys):
    """SSD tier over the directory ``path``: at most ``capacity_bytes`` of block data on disk.

    One DiskTier per directory (a lock file enforces it, across processes too). All methods are thread-safe
    and block the calling thread until their I/O is done, except ``put_later``. ``slot_bytes`` is the block
    size rounded up to 4 KiB with O_DIRECT (capacity counts slots), or the block size itself without.
    """

    name = "ssd"

    def __init__(
        self, path: str | os.PathLike[str], capacity_bytes: int, block_bytes: int, *,
        segment_bytes: int = 256 << 20, policy: str = "lru", direct_io: str = "auto", fsync: bool = True,
        io_threads: int = 4, staging_bytes: int = 64 << 20, fingerprint: str = "", dtypes: Sequence[str] = (),
        clock: Clock | None = None,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if direct_io not in ("auto", "true", "false"):
            raise ValueError(f"direct_io must be auto, true or false, got {direct_io!r}")
        self.block_bytes = block_bytes
        self.path = Path(path)
        private_dir(self.path)  # segment files hold KV blocks (users' prompts), 0600 each (io.py)
        self._dir_lock = lock_directory(self.path)
        try:
            self.direct = self._choose_direct_io(direct_io)
            self.slot_bytes = round_up(block_bytes, ALIGN) if self.direct else block_bytes
            num_slots = capacity_bytes // self.slot_bytes
            if num_slots == 0:
                raise ValueError(f"SSD capacity {capacity_bytes} B holds no block of {self.slot_bytes} B")
            self.capacity_bytes = num_slots * self.slot_bytes
            per_segment = max(1, segment_bytes // self.slot_bytes)
            self._files = SegmentFiles(self.path, self.slot_bytes, per_segment, num_slots, self.direct)
        except BaseException:
            os.close(self._dir_lock)
            raise
        self._fsync = fsync
        self._fingerprint = xxhash.xxh3_64_intdigest(f"{fingerprint}|{block_bytes}".encode())
        self._dtypes = tuple(dtypes)
        self._slots = DiskSlots(self.name, num_slots, self.capacity_bytes, block_bytes, policy, clock, self.path)
        self._closed = False
        try:
            self._index = self._open_index(map_size=max(64 << 20, num_slots * 256))
        except BaseException:
            self._files.close()
            os.close(self._dir_lock)
            raise
        self._io = IoThreads(io_threads, "kvtier-ssd-io", "SSD tier")
        self._dev = SlotDevice(self._files, self._io, block_bytes, self.slot_bytes, self.direct)
        # Bounce buffers for unaligned callers always exist; write-behind copies only when staging_bytes > 0.
        self._staging = StagingPool(self.slot_bytes, max(2, staging_bytes // self.slot_bytes))
        self._disk = DiskWriter(self._slots, self._dev, self._index, self._staging, fsync=fsync,
                                fingerprint=self._fingerprint)
        # Write-behind stages into the same pool; its staged map is DiskSlots.staged under DiskSlots.lock, which
        # reads, remove and slot reservation consult (writebehind.py's module doc: the SSD's hooks).
        self._behind = (WriteBehind(self._write_staged, self._staging, block_bytes=block_bytes,
                                    max_batch=max(1, (64 << 20) // self.slot_bytes), name="ssd", what="SSD",
                                    lock=self._slots.lock, staged=self._slots.staged, held=self._slots.held_or_pending,
                                    count=self._count_write_behind)
                        if staging_bytes else None)

    # ---- Tier protocol ---------------------------------------------------------------------------------

    @property
    def observes(self) -> bool:
        """Whether this tier's policy learns from observations (TieredStore.observe sends them only then)."""
        return self._slots.policy.observes

    def observe(self, batch: Observations) -> None:
        """Hand the policy a batch of observations (sessions and times filled in: TieredStore.observe)."""
        with self._slots.lock:
            self._slots.policy.observe(batch)

    def attach(self, pins: PinTable, on_evict: EvictListener | None) -> None:
        """Pins keep blocks from eviction; ``on_evict(keys, [])`` hears evictions and blocks dropped as damaged
        (failed checksums or reads, ``check()``) (no views: nothing below this tier to demote them to)."""
        with self._slots.lock:
            self._slots.protected.pins = pins
            self._slots.on_evict = on_evict

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Committed blocks and blocks queued for write-behind (readable from staging meanwhile)."""
        slot_of, staged = self._slots.slot_of, self._slots.staged
        return [k in slot_of or k in staged for k in keys]  # dict reads are atomic under the GIL

    def put(self, keys: Sequence[bytes], blocks: Any) -> list[bool]:
        """Write blocks and return when they are durable (fsync'ed and indexed, unless fsync is off).

        True where the key is held afterwards; False where refused (no evictable slot, or admission stopped).
        """
        rows = block_rows(blocks, len(keys), self.block_bytes, dtypes=self._dtypes)
        return self._disk.store_rows(keys, rows.ptrs)[0]

    def get(self, keys: Sequence[bytes], out: Any) -> list[bool]:
        """Read held blocks into ``out``, all of a batch's reads in flight together; verify every checksum.

        A block failing verification (or its read) is a miss: it is dropped, counted, and its ``out`` row is
        zeroed if the read had landed there. Other ``out`` rows of misses are left untouched.
        """
        rows = block_rows(out, len(keys), self.block_bytes, writable=True, dtypes=self._dtypes, what="out")
        hit = [False] * len(keys)
        reads: list[tuple[int, int, int]] = []  # (index in batch, slot, checksum)
        b = self._slots
        with b.lock:
            for i, k in enumerate(keys):
                s = b.slot_of.get(k)
                if s is not None:
                    reads.append((i, s, int(b.checksum[s])))
                elif k in b.staged:  # still on its way to disk: serve the staged copy
                    copy_rows(rows.ptrs[i : i + 1], np.array([b.staged[k]], np.uint64), self.block_bytes)
                    hit[i] = True
            slots = [s for _, s, _ in reads]
            b.hold(slots)
            b.policy.access([keys[i] for i, _, _ in reads])
        failures: list[ReadFailure] = []
        try:
            if reads:
                failures = read_slots(self._dev, keys, rows.ptrs, reads)
        finally:
            failed = {f.index for f in failures}
            for i, _, _ in reads:
                hit[i] = i not in failed
            self._after_reads(keys, slots, failures)
        with b.lock:
            st = b.stats
            st.hits += sum(hit)
            st.misses += len(keys) - sum(hit)
            st.get_bytes += sum(hit) * self.block_bytes
        return hit

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop keys (committed, queued or being written); return how many were held."""
        return self._drop(keys)

    def hand_up(self, keys: Sequence[bytes], session: str, depths: Sequence[int]) -> None:
        """remove, the policy remembering the keys as the agent's (HandsUp: a prefetch moved them into DRAM)."""
        self._drop(keys, lambda policy: policy.handed_up(session, keys, depths))

    def _drop(self, keys: Sequence[bytes], tell: Callable[[GuardedPolicy], None] | None = None) -> int:
        b = self._slots
        with b.lock:
            # Committed slots stay busy until the index forgets their keys (crash ordering); a key being written
            # is forgotten too (its writer sees it gone and frees the slot when done).
            committed, freed = b.drop(keys, hold=True)
            gone = set(committed)
            staged = sum(b.staged.pop(k, None) is not None for k in keys if k not in gone)
            if tell is not None:
                tell(b.policy)
        self._disk.unindex(committed, freed)
        return len(committed) + staged

    def stats(self) -> TierStats:
        b = self._slots
        with b.lock:
            s = b.stats
            s.blocks = len(b.slot_of)
            s.used_bytes = b.alloc.used_count * self.slot_bytes
            s.extra = {"admitting": not b.stopped, "stopped_reason": b.stopped, "path": str(self.path),
                       "direct_io": self.direct, "fsync": self._fsync, "slot_bytes": self.slot_bytes,
                       "segments": self._files.num_segments, "staged": len(b.staged),
                       "pending": len(b.pending), "staging_in_use": self._staging.in_use, **b.counts}
            return s

    def close(self) -> None:
        """Finish queued write-behind, then release the files, the index and the directory lock."""
        if self._closed:
            return
        self._closed = True
        if self._behind is not None:
            self._behind.close()
        self._io.close()
        self._files.close()
        self._index.close()
        os.close(self._dir_lock)

    # ---- beyond the protocol ---------------------------------------------------------------------------

    def keys(self) -> list[bytes]:
        """Every key held now, committed or queued for write-behind (a snapshot, as DramTier.keys)."""
        b = self._slots
        with b.lock:
            return [*b.slot_of, *(k for k in b.staged if k not in b.slot_of)]

    def put_later(self, keys: Sequence[bytes], blocks: Any, *, wait: bool) -> Future[list[bytes]] | None:
        """Copy blocks into staging memory now and write them in the background; the Future gives the keys
        newly held on disk. Keys already held or queued are skipped. Without ``wait``, blocks that find no
        staging memory are dropped (counted as ``offload_dropped``); with it, the call waits for memory (at
        most STAGE_TIMEOUT_S). Returns None when the tier does not admit. Never raises for I/O errors.

        With write-behind off (``staging_bytes=0``) the blocks are written before this returns.
        """
        if self._slots.stopped or self._closed:
            return None
        rows = block_rows(blocks, len(keys), self.block_bytes, dtypes=self._dtypes)
        if self._behind is None:
            done: Future[list[bytes]] = Future()
            done.set_result(self._disk.store_rows(keys, rows.ptrs)[1])
            return done
        return self._behind.submit(keys, rows.ptrs, wait=wait)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-behind block is on disk (or failed); False on timeout."""
        return True if self._behind is None else self._behind.flush(timeout)

    def check(self) -> int:
        """Drop blocks whose segment file was deleted, replaced or truncated under us; return how many.

        Reads notice a truncated file by themselves (a short read is a miss); a deleted file is still readable
        through our open descriptor, but its blocks would vanish at the next restart, so they go now.
        """
        sizes = self._files.scan()
        doomed_segments = set()
        for seg in range(self._files.num_segments):
            if self._files.unlinked(seg):
                doomed_segments.add(seg)
                self._files.forget(seg)
        place = self._files.place
        with self._slots.lock:
            failures = [ReadFailure(-1, s, "segment_file_gone", None, k) for k, s in self._slots.slot_of.items()
                        if place(s)[0] in doomed_segments or sizes.get(place(s)[0], 0) < place(s)[1] + self.slot_bytes]
        self._after_reads([], [], failures)
        return len(failures)

    # ---- internals ----------------------------------------------------------------------------------------

    # Read-only views into DiskSlots, named as DramTier's (tests locate a block's bytes and inspect the policy).
    @property
    def _slot_of(self) -> dict[bytes, int]:
        return self._slots.slot_of

    @property
    def _policy(self) -> GuardedPolicy:
        return self._slots.policy

    def _write_batch(self, keys: Sequence[bytes], ptrs: np.ndarray, *, staged: bool
                     ) -> tuple[list[bool], list[bytes]]:
        """Where write-behind's batches reach the disk (DiskWriter.write_batch); a subclass may hold them here."""
        return self._disk.write_batch(keys, ptrs, staged=staged)

    def _write_staged(self, keys: list[bytes], ptrs: np.ndarray) -> set[bytes]:
        """Write-behind's batch (writer thread): the keys newly on disk and indexed."""
        return set(self._write_batch(keys, ptrs, staged=True)[1])

    def _count_write_behind(self, event: Event, n: int) -> None:
        if event == "dropped" and n:  # DiskSlots.lock held
            self._slots.counts["offload_dropped"] += n

    def _after_reads(self, keys: Sequence[bytes], slots: Sequence[int], failures: Sequence[ReadFailure]) -> None:
        """Release read slots; drop blocks that failed (a miss, counted, never data)."""
        damaged: list[bytes] = []
        b = self._slots
        with b.lock:
            for f in failures:
                k = f.key if f.key is not None else keys[f.index]
                b.counts[f.reason] += 1
                if b.slot_of.get(k) == f.slot:  # not replaced meanwhile
                    damaged.append(k)
            dropped, freed = b.drop(damaged, hold=True)  # slots held until unindexed
            b.release(slots)
        b.report_gone(dropped)
        if failures:
            f = failures[0]
            log.warning("SSD tier: %d blocks failed (%s), served as misses and dropped; first: key %s slot %d%s",
                        len(failures), ", ".join(sorted({x.reason for x in failures})),
                        (f.key or keys[f.index]).hex(), f.slot, f": {f.error}" if f.error else "")
            eio = next((x.error for x in failures if x.error is not None and x.error.errno == errno.EIO), None)
            if eio is not None:
                b.stop_admitting(eio, "read")
        self._disk.unindex(dropped, freed)

    # ---- opening -----------------------------------------------------------------------------------------

    def _open_index(self, map_size: int) -> DiskIndex:
        """Open the index and restore from it; a damaged index (a machine crash with fsync off, a disk error)
        costs the cached blocks, never the store: the directory is wiped and starts empty."""
        where = self.path / "index"
        for attempt in (0, 1):
            index = None
            try:
                index = DiskIndex(where, sync=self._fsync, map_size=map_size)
                self._restore(index)
                return index
            except (IndexFault, lmdb.Error) as e:
                if index is not None:
                    index.close()
                if attempt:
                    raise
                log.error("SSD tier at %s: its index cannot be read (%s); discarding the cached blocks and "
                          "starting empty", self.path, e)
                shutil.rmtree(where, ignore_errors=True)
                self._files.remove_all()
        raise AssertionError("unreachable")

    def _restore(self, index: DiskIndex) -> None:
        """Load the index, keeping only entries the segment files can back (warm restart)."""
        found = restore_index(index, self._files, self.block_bytes, self._fingerprint)
        b = self._slots  # nothing else sees the tier yet: no lock needed
        for slot, key, checksum in found.blocks:
            b.slot_of[key] = slot
            b.checksum[slot] = checksum
        b.policy.insert([key for _, key, _ in found.blocks])  # oldest write first: eviction order survives
        if found.blocks:  # take the used slots out of the allocator; the lowest free slot stays on top
            used = np.array([slot for slot, _, _ in found.blocks], dtype=np.int64)
            b.alloc.alloc(self._files.num_slots)
            b.alloc.free(np.setdiff1d(np.arange(self._files.num_slots), used).tolist())
        b.seq = found.next_seq
        b.counts["restored"] = len(found.blocks)
        b.counts.update({f"dropped_at_open_{r}": n for r, n in found.dropped.items()})

    def _choose_direct_io(self, mode: str) -> bool:
        if mode == "false":
            return False
        reason = probe_direct_io(self.path)
        if not reason:
            return True
        if mode == "true":
            raise OSError(errno.EINVAL, f"ssd_direct_io is true but {self.path} cannot do O_DIRECT: {reason}")
        log.warning("SSD tier at %s: no O_DIRECT on this filesystem (%s); using buffered I/O, so reads may come "
                    "from the page cache (put the tier on a real disk for device-speed figures)", self.path, reason)
        return False


__all__ = ["DirectoryInUse", "DiskTier"]
