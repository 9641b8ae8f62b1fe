"""Slot bookkeeping shared by the tiers that keep blocks in fixed-size slots (DRAM and SSD).

``SlotAllocator`` hands out free slot indices in batches, no allocation per put; ``ProtectedSlots`` is what
eviction must not take; ``SlotTable`` is the key -> slot map around them, with the two-phase write (reserve,
publish), removal and eviction rules both tiers follow. What differs stays in the tiers: DRAM's leaving keys
handed down outside its lock and its in-place copies, the SSD's segments, checksums and crash ordering.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Sequence
from typing import Literal, NamedTuple

import numpy as np

from kvtier.keys.table import KeyTable, key_array
from kvtier.pins import PinTable
from kvtier.policies import Clock, make_policy
from kvtier.policies.guard import GuardedPolicy
from kvtier.tiers.base import Reservation, TierStats

log = logging.getLogger(__name__)


class SlotAllocator:
    """A stack of free slot indices in a numpy array. Not thread-safe: the owning tier locks around it."""

    def __init__(self, num_slots: int, on_free: Callable[[np.ndarray], None] | None = None) -> None:
        if num_slots <= 0:
            raise ValueError(f"need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.on_free = on_free  # told every slot that goes free (the pool: bump its generation)
        # Lowest slots on top, so a lightly used tier touches (and faults in) the start of its buffer only.
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._top = num_slots  # free[:top] are free
        self._is_free = np.ones(num_slots, dtype=bool)

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used_count(self) -> int:
        return self.num_slots - self._top

    def alloc(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when the buffer is full)."""
        take = min(n, self._top)
        if take <= 0:
            return []
        slots = self._free[self._top - take : self._top][::-1]
        self._top -= take
        self._is_free[slots] = False
        return slots.tolist()

    def free(self, slots: Sequence[int]) -> None:
        """Return slots. Freeing a slot twice is a bug in the caller and raises instead of corrupting."""
        if not len(slots):
            return
        arr = np.asarray(slots, dtype=np.int64)
        if self._is_free[arr].any() or len(np.unique(arr)) != len(arr):
            raise RuntimeError(f"slot freed twice: {sorted(set(arr[self._is_free[arr]].tolist()))}")
        self._free[self._top : self._top + len(arr)] = arr[::-1]
        self._top += len(arr)
        self._is_free[arr] = True
        if self.on_free is not None:
            self.on_free(arr)

    def free_idle(self, doomed: set[int], busy: np.ndarray) -> None:
        """Free the slots of ``doomed`` (dropped while in use) that ``busy`` now shows idle; keep the rest."""
        if doomed:
            idle = [s for s in doomed if busy[s] == 0]
            if idle:
                doomed.difference_update(idle)
                self.free(idle)


class ProtectedSlots:
    """What eviction must not take: pinned keys and keys whose slot is busy (being copied, read or written).

    A ``Container`` for ``EvictionPolicy.victims``; reads the owning tier's live maps (call under its lock).
    """

    __slots__ = ("pins", "slot_of", "busy")

    def __init__(self, pins: PinTable, slot_of: dict[bytes, int], busy: np.ndarray) -> None:
        self.pins, self.slot_of, self.busy = pins, slot_of, busy

    def __contains__(self, key: object) -> bool:
        return key in self.pins or self.busy[self.slot_of[key]] > 0  # type: ignore[index]


class Taken(NamedTuple):
    """What ``SlotTable.reserve`` did: ``res`` (the keys given slots, now pending and busy, and the batch's
    held mask) and the keys it evicted to make room, with the slots they held (now ``res``'s)."""

    res: Reservation
    victims: list[bytes]
    victim_slots: list[int]


Admission = Literal["enforce", "advice", "off"]


class SlotTable:
    """Which key holds which slot of one tier, and the life of a slot: free -> pending -> committed -> free.

    The slot bookkeeping DramTier (composes one) and the SSD tier (``DiskSlots`` derives from it) share. Not
    thread-safe: every method and field is used under the owning tier's lock, which it never releases here;
    the owner does its byte copies and I/O, and calls its eviction listener, outside that lock.

    A slot is in exactly one of: free (``alloc``), ``pending`` (reserved by a write in flight), committed
    (``slot_of``), or doomed (dropped while ``busy``: its readers, its writer, or for the SSD an index entry not
    yet deleted, count in ``busy``; it is freed when that count reaches 0, ``free_idle_doomed``). With
    ``leaving`` (DRAM), an evicted key moves to ``leaving`` (key -> its old slot, now its new owner's) before it
    leaves ``slot_of`` (both under the owner's lock, as every reader is), so a reader still finds it held, and
    readable at its old slot, until its hand-down ends; the owner ends that state
    (``end_leaving``). With ``leaving`` the held keys (``slot_of`` and ``leaving``) are also indexed in a native
    KeyTable (``held``: one probe pass per batch, no Python work per key: what every lookup of the store asks; an
    evicted key stays in it until its hand-down ends, like ``leaving``).

    Eviction rules (``reserve``): free slots first, then the policy's victims, never a pinned or busy key nor a
    key of the batch (or of ``protect``) the tier holds; when slots run short the root-most keys get them (the
    policy's ``admit`` order where it has one and ``admission`` is not "off", else batch order) and the
    tail-most are refused. ``admission`` "enforce" stores none of what ``admit`` declines, "advice" stores it
    after the rest, "off" never asks.
    """

    def __init__(self, num_slots: int, policy: str, clock: Clock | None, *, stats: TierStats, block_bytes: int,
                 where: str, admission: Admission = "off", leaving: bool = False,
                 scan_busy: bool = False) -> None:
        self.alloc = SlotAllocator(num_slots)
        self.slot_of: dict[bytes, int] = {}  # committed blocks
        # The policy reads time from ``clock``; one that raises is logged once and replaced by LRU order.
        self.policy = GuardedPolicy(make_policy(policy, num_slots, clock=clock), self.slot_of.keys, where)
        self.pending: dict[bytes, int] = {}  # key -> slot being written
        self.busy = np.zeros(num_slots, dtype=np.int32)  # in-flight copies, reads and writes per slot
        self.doomed: set[int] = set()  # dropped while busy: freed when idle
        self.leaving: dict[bytes, int] | None = {} if leaving else None
        # Keys of slot_of or leaving, kept with them (publish, drop, end_leaving): ``held``'s one-pass answer.
        self.index: KeyTable | None = KeyTable() if leaving else None
        self.protected = ProtectedSlots(PinTable(), self.slot_of, self.busy)
        self.stats = stats  # evictions, rejected, puts and put_bytes counted here
        self.declined = 0  # new keys the policy's admission did not take
        self._block_bytes = block_bytes
        self._where = where
        self._admission = admission
        # A DRAM-sized table scans ``busy`` to skip the per-candidate check when nothing is pinned or busy (a
        # trace replay evicts millions of blocks); an SSD's table can be millions of slots: it always checks.
        self._scan_busy = scan_busy
        self._bad_admit = False  # logged once: the policy's admit answered nonsense

    def reserve(self, keys: Sequence[bytes], protect: Sequence[bytes] = (),
                only: Container[bytes] | None = None, *, leaving_held: bool = False) -> Taken:
        """Take a slot for each key of ``keys`` neither committed nor pending (and, with ``only``, in it;
        with ``leaving_held``, not leaving either: held as ``held`` says), first occurrences only, evicting by
        the rules above. ``res.held[i]`` is False where key i was refused or declined; the reserved keys are
        pending and their slots busy until ``publish``. This is the tier's one question about each key of a
        write: asked under the owner's lock, in the step that takes the slot."""
        n = len(keys)
        if self.index is not None:
            key_array(keys)  # a batch that is not 16 bytes per key fails here, before any state changes
        res = Reservation([True] * n)
        victims: list[bytes] = []
        vslots: list[int] = []
        slot_of, pending = self.slot_of, self.pending
        leaving = self.leaving if leaving_held and self.leaving else None  # none leaving (the common case): no ask
        if (only is None and slot_of.keys().isdisjoint(keys) and pending.keys().isdisjoint(keys)
                and (leaving is None or leaving.keys().isdisjoint(keys))):
            new = list(range(n))  # all new (a put of fresh blocks): two set operations, no loop per key
        else:
            new = [i for i in range(n) if keys[i] not in slot_of and keys[i] not in pending
                   and (leaving is None or keys[i] not in leaving) and (only is None or keys[i] in only)]
        if not new:
            return Taken(res, victims, vslots)
        if len(set(keys) if len(new) == n else {keys[i] for i in new}) < len(new):
            new = _first_occurrences(keys, new)
        held, free = res.held, self.alloc.free_count
        if free < len(new) and self._admission != "off":
            chosen = self._admitted(keys, new)
            if len(chosen) < len(new):
                for i in set(new).difference(chosen):
                    held[i] = False  # declined: not stored
            new = chosen
        # Keys of this batch (and ``protect``) already held must not be evicted to make room for its new ones.
        keep = ([slot_of[k] for k in (*keys, *protect) if k in slot_of]
                if (len(new) < n or protect) and free < len(new) else [])
        if keep:  # held while victims are chosen (busy: never evicted)
            np.add.at(self.busy, keep, 1)
        slots = self._take(len(new), victims, vslots)
        if keep:
            np.subtract.at(self.busy, keep, 1)
        # The first len(slots) of ``new`` (root-most first) are stored, in batch order: clients of the pool map
        # slots to the batch positions they were given, ascending.
        res.index = sorted(new[: len(slots)])
        for i in new[len(slots):]:
            held[i] = False
        self.stats.rejected += len(new) - len(slots)
        res.keys = list(keys) if len(res.index) == n else [keys[i] for i in res.index]  # index is ascending
        res.slots = slots
        pending.update(zip(res.keys, slots))
        self.busy[_slot_array(slots)] += 1  # slots are distinct: plain fancy-index add is safe
        return Taken(res, victims, vslots)

    def publish(self, keys: Sequence[bytes], slots: Sequence[int], success: bool = True
                ) -> tuple[list[bytes], list[bytes]]:
        """End the writes of ``reserve``: commit each key still pending in its slot (with success=False, doom
        the slot instead). Returns (committed keys, keys dropped while being written: their slots are doomed)."""
        published: list[bytes] = []
        lost: list[bytes] = []
        slots = list(slots)
        self.busy[_slot_array(slots)] -= 1  # a reservation's slots are distinct
        pending, slot_of = self.pending, self.slot_of
        if success and list(map(pending.get, keys)) == slots:
            # Every key still pending in its slot (nothing removed it meanwhile: the common case): the maps
            # change in bulk, with no test per key.
            for k in keys:
                del pending[k]
            slot_of.update(zip(keys, slots))
            published = list(keys)
        else:
            for k, s in zip(keys, slots):
                if pending.get(k) == s:
                    del pending[k]
                    if success:
                        slot_of[k] = s
                        published.append(k)
                        continue
                    self.doomed.add(s)
                else:  # removed while being written: drop() doomed the slot
                    lost.append(k)
        self.policy.insert(published)
        if self.index is not None and published:
            # A published key was pending, so not committed: the index (committed and leaving keys) lacks it
            # unless it is leaving too (evicted, then put again before its hand-down ended). With none leaving it
            # is placed without a probe for it.
            self.index.add(key_array(published), absent=not self.leaving)
        self.free_idle_doomed()
        self.stats.puts += len(published)
        self.stats.put_bytes += len(published) * self._block_bytes
        return published, lost

    def drop(self, keys: Sequence[bytes], *, hold: bool = False) -> tuple[list[bytes], list[int]]:
        """Forget keys, committed or pending; return the committed ones and their slots. A pending key's slot
        is doomed (its writer's ``publish`` sees the key gone). A committed key's slot is freed, or doomed while
        busy; with ``hold`` it is doomed and kept busy until the owner ``release``s it (the SSD: until the
        index no longer points at it)."""
        removed: list[bytes] = []
        freed: list[int] = []
        idle: list[int] = []  # freed at once, in one batch (a free per key cost a numpy round per key)
        slot_of, pending, busy, doomed = self.slot_of, self.pending, self.busy, self.doomed
        for k in keys:
            s = slot_of.pop(k, None)
            if s is not None:
                removed.append(k)
                freed.append(s)
                if hold:
                    doomed.add(s)
                    busy[s] += 1
                elif busy[s]:
                    doomed.add(s)
                else:
                    idle.append(s)
            s = pending.pop(k, None)
            if s is not None:
                doomed.add(s)
        self.alloc.free(idle)
        self.policy.remove(removed)
        self._unindex(removed, self.leaving)
        return removed, freed

    def held(self, keys: Sequence[bytes]) -> np.ndarray:
        """A bool per key: committed or leaving (with ``leaving``: needs the index). ValueError for a key that is
        not 16 bytes."""
        if self.index is None:
            raise TypeError(f"{self._where}: held() answers from the index of a table with leaving keys")
        if not keys:
            return np.zeros(0, bool)
        return self.index.find(key_array(keys)) >= 0

    def end_leaving(self, victims: Sequence[bytes], vslots: Sequence[int]) -> None:
        """End the leaving state of evicted keys (their hand-down is over): a victim still leaving from its
        slot is no longer held here, unless it was put again meanwhile."""
        leaving = self.leaving
        assert leaving is not None
        gone = []
        for v, s in zip(victims, vslots):
            if leaving.get(v) == s:
                del leaving[v]
                gone.append(v)
        self._unindex(gone, self.slot_of)

    def clear(self) -> None:
        """Forget every committed key (the tier is closing)."""
        self.slot_of.clear()
        if self.index is not None:
            self.index.clear()

    def _unindex(self, keys: list[bytes], still: dict[bytes, int] | None) -> None:
        """Take ``keys`` out of the index, except those ``still`` holds (a key both leaving and put again)."""
        if self.index is None or not keys:
            return
        if still:
            keys = [k for k in keys if k not in still]
        if keys:
            self.index.delete(self.index.find(key_array(keys)))

    def hold(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Mark slots busy (a read or copy starts: not evicted, not reused); one count per occurrence. Returns the
        slots as an int64 array (for the caller's addresses, and to hand back to ``release``)."""
        held = _slot_array(slots)
        _add_per_occurrence(self.busy, held, 1)
        return held

    def release(self, slots: Sequence[int] | np.ndarray) -> None:
        """End what ``hold`` (or ``drop(hold=True)``) started; doomed slots now idle go back to the allocator."""
        _add_per_occurrence(self.busy, _slot_array(slots), -1)
        self.free_idle_doomed()

    def free_idle_doomed(self) -> None:
        """Return doomed slots that nothing uses any more to the allocator."""
        self.alloc.free_idle(self.doomed, self.busy)

    def _take(self, n: int, victims: list[bytes], vslots: list[int]) -> list[int]:
        """Up to ``n`` slots, evicting where none is free; the evicted keys and their slots are appended to
        ``victims`` and ``vslots`` (and, with ``leaving``, left there until their owner ends it)."""
        slots = self.alloc.alloc(n)
        short = n - len(slots)
        if short > 0:
            protected: Container[bytes] = self.protected
            if self._scan_busy and not len(protected.pins) and not self.busy.any():
                protected = _NOTHING  # nothing pinned or being copied (the common case): skip the checks
            evicted = self.policy.victims(short, protected)
            if evicted:
                slot_of, leaving = self.slot_of, self.leaving
                taken = [slot_of[v] for v in evicted]
                if leaving is None:
                    for v in evicted:
                        del slot_of[v]
                else:
                    for v, s in zip(evicted, taken):
                        leaving[v] = s  # still held (readable here) until its hand-down ends
                        del slot_of[v]
                self.stats.evictions += len(evicted)
                victims += evicted
                vslots += taken
                slots += taken
        return slots

    def _admitted(self, keys: Sequence[bytes], new: list[int]) -> list[int]:
        """The positions of ``new`` to store, root-most first, by the policy's ``admit`` (all of them in batch
        order where it has no view). With "advice" admission the declined ones are stored too, after the rest.
        An answer that repeats or makes up a position counts as none: everything is stored."""
        order = self.policy.admit([keys[i] for i in new], self.alloc.free_count)
        chosen = _positions(new, order) if order is not None else None
        if chosen is None:
            if order is not None and not self._bad_admit:
                self._bad_admit = True
                log.error("%s: policy %r answered admit with a position repeated or out of range (of %d new "
                          "keys); storing whole batches whenever it does", self._where, self.policy.name, len(new))
            return new
        if len(chosen) < len(new) and self._admission == "advice":
            taken = set(chosen)
            chosen += [i for i in new if i not in taken]
        self.declined += len(new) - len(chosen)
        return chosen


_NOTHING: frozenset[bytes] = frozenset()


def _slot_array(slots: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(slots, np.ndarray):
        return slots.astype(np.int64, copy=False)
    return np.fromiter(slots, np.int64, len(slots))


def _add_per_occurrence(counts: np.ndarray, slots: np.ndarray, delta: int) -> None:
    """counts[s] += delta once per occurrence of s in ``slots``. A fancy-index add counts a repeated slot once, so
    it is used where no slot repeats (a batch without repeated keys: every get but a caller's odd one), checked on
    the sorted slots; ufunc.at, which counts repeats but costs ~10x as much per slot, only where one does."""
    if len(slots) > 1:
        ordered = np.sort(slots)
        if (ordered[1:] == ordered[:-1]).any():
            np.add.at(counts, slots, delta)
            return
    counts[slots] += delta


def _positions(new: list[int], order: Sequence[int]) -> list[int] | None:
    """``new[j]`` for each j of a policy's answer, in its order; None if the answer repeats a position or
    names one out of range (a policy's bug: the tier logs it once and stores the whole batch)."""
    n = len(new)
    seen: set[int] = set()
    out = []
    for j in order:
        if type(j) is not int or not 0 <= j < n or j in seen:  # noqa: E721 - a bool is not a position
            return None
        seen.add(j)
        out.append(new[j])
    return out


def _first_occurrences(keys: Sequence[bytes], index: list[int]) -> list[int]:
    """Drop repeats of a key within one batch: only its first occurrence is written."""
    seen: set[bytes] = set()
    out = []
    for i in index:
        if keys[i] not in seen:
            seen.add(keys[i])
            out.append(i)
    return out
