"""SlotTable, the slot bookkeeping the DRAM and SSD tiers share, against a plain model of its rules.

Random sequences of reserve / publish (commit or give back) / drop / pin / unpin / hold / release run on a real
SlotTable configured as each tier configures it (DRAM: leaving state ended after each reserve, as the hand-down
does, removals free idle slots at once, the busy scan; SSD: no leaving, removals hold the slot until the index
forgets the key, released later) and on a model that knows only the rules: new keys are the first occurrences
of keys neither committed nor pending; free slots first, then LRU victims that are not pinned, busy, or a key
of the batch or of ``protect``; the root-most (first) new keys get the slots, the tail-most are refused; a
slot is never in two places, never leaks, and a dropped slot comes back only when nothing uses it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.base import Reservation, TierStats
from kvtier.tiers.slots import SlotTable

NUM_SLOTS = 4
KEYS = [(b"k%d" % i).ljust(16, b".") for i in range(8)]  # 16 bytes: a DRAM table indexes its keys
key_lists = st.lists(st.sampled_from(KEYS), max_size=7)


class SlotTableModel(RuleBasedStateMachine):
    """One tier's use of a SlotTable beside the model (``DRAM`` selects which)."""

    DRAM = True

    def __init__(self) -> None:
        super().__init__()
        self.stats = TierStats("t", NUM_SLOTS, 0, 0)
        self.t = SlotTable(NUM_SLOTS, "lru", None, stats=self.stats, block_bytes=1, where="test tier",
                           admission="enforce" if self.DRAM else "off", leaving=self.DRAM, scan_busy=self.DRAM)
        self.pins = self.t.protected.pins
        # The model.
        self.committed: dict[bytes, int] = {}  # key -> slot (slots are the table's: the model checks them)
        self.pending: dict[bytes, int] = {}
        self.lru: list[bytes] = []  # oldest first
        self.busy: Counter[int] = Counter()  # expected busy count per slot
        self.pinned: Counter[bytes] = Counter()
        self.writes: list[Reservation] = []  # reserved, not yet published
        self.reads: list[list[int]] = []  # held slots, not yet released
        self.unindexing: list[list[int]] = []  # SSD: dropped slots held until the index forgets them

    # ---- the model's rules -----------------------------------------------------------------------------

    def _free(self) -> int:
        used = set(self.committed.values()) | set(self.pending.values()) | {s for s, n in self.busy.items() if n}
        return NUM_SLOTS - len(used)

    def _victims(self, n: int, protected: set[bytes]) -> list[bytes]:
        """LRU: oldest first; a protected key passed over moves to the newest end (kvtier/policies/lru.py)."""
        out: list[bytes] = []
        for _ in range(len(self.lru)):
            if len(out) >= n:
                break
            k = self.lru.pop(0)
            if k in protected:
                self.lru.append(k)
            else:
                out.append(k)
        return out

    # ---- rules -----------------------------------------------------------------------------------------

    @rule(keys=key_lists, protect=st.lists(st.sampled_from(KEYS), max_size=3))
    def reserve(self, keys: list[bytes], protect: list[bytes]) -> None:
        new: list[int] = []
        for i, k in enumerate(keys):
            if k not in self.committed and k not in self.pending and all(keys[j] != k for j in new):
                new.append(i)
        free = self._free()
        victims: list[bytes] = []
        if len(new) > free:
            guarded = {k for k in (*keys, *protect) if k in self.committed}
            busy_keys = {k for k, s in self.committed.items() if self.busy[s]}
            victims = self._victims(len(new) - free, guarded | busy_keys | set(+self.pinned))
        granted = min(len(new), free + len(victims))
        held = [True] * len(keys)
        for i in new[granted:]:
            held[i] = False

        res, got_victims, vslots = self.t.reserve(keys, protect)
        if self.DRAM:  # the hand-down ends: the victims leave the leaving map
            assert self.t.leaving is not None and set(self.t.leaving) == set(got_victims)
            assert self.t.held(got_victims).all()  # held (readable here) while they go down
            self.t.end_leaving(got_victims, vslots)
            assert not self.t.leaving
        assert got_victims == victims
        assert res.held == held
        assert res.index == new[:granted] and res.keys == [keys[i] for i in new[:granted]]
        assert len(set(res.slots)) == len(res.slots)
        taken = {self.committed.pop(v) for v in victims}
        assert set(vslots) == taken and taken <= set(res.slots)
        for k, s in zip(res.keys, res.slots):
            assert s in taken or (s not in self.committed.values() and s not in self.pending.values()
                                  and not self.busy[s]), "a reserved slot was in use"
            self.pending[k] = s
            self.busy[s] += 1
        if res.slots:
            self.writes.append(res)

    @precondition(lambda self: self.writes)
    @rule(pick=st.integers(0, 99), success=st.booleans())
    def publish(self, pick: int, success: bool) -> None:
        res = self.writes.pop(pick % len(self.writes))
        published, lost = self.t.publish(res.keys, res.slots, success)
        expect_pub, expect_lost = [], []
        for k, s in zip(res.keys, res.slots):
            self.busy[s] -= 1
            if self.pending.get(k) == s:
                del self.pending[k]
                if success:
                    self.committed[k] = s
                    self.lru.append(k)
                    expect_pub.append(k)
            else:
                expect_lost.append(k)
        assert (published, lost) == (expect_pub, expect_lost)

    @rule(keys=key_lists)
    def drop(self, keys: list[bytes]) -> None:
        removed, slots = self.t.drop(keys, hold=not self.DRAM)
        expect = []
        for k in keys:
            s = self.committed.pop(k, None)
            if s is not None:
                expect.append((k, s))
                self.lru.remove(k)
            self.pending.pop(k, None)  # its slot stays busy (its reservation) until publish
        assert list(zip(removed, slots)) == expect
        if not self.DRAM:
            for s in slots:
                self.busy[s] += 1
            self.unindexing.append(slots)

    @precondition(lambda self: self.unindexing)
    @rule()
    def unindexed(self) -> None:
        slots = self.unindexing.pop(0)
        self.t.release(slots)
        for s in slots:
            self.busy[s] -= 1

    @rule(keys=key_lists)
    def hold(self, keys: list[bytes]) -> None:
        """A read (DramTier.acquire, DiskTier.get): the held blocks become most recent and busy."""
        hits = [k for k in keys if k in self.committed]
        self.t.policy.access(hits)
        slots = [self.t.slot_of[k] for k in hits]
        self.t.hold(slots)
        for k in hits:
            self.lru.remove(k)
            self.lru.append(k)
            self.busy[self.committed[k]] += 1
        self.reads.append(slots)

    @precondition(lambda self: self.reads)
    @rule(pick=st.integers(0, 99))
    def release(self, pick: int) -> None:
        slots = self.reads.pop(pick % len(self.reads))
        self.t.release(slots)
        for s in slots:
            self.busy[s] -= 1

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def pin(self, keys: list[bytes]) -> None:
        self.pins.pin(keys)
        self.pinned.update(keys)

    @precondition(lambda self: +self.pinned)
    @rule(pick=st.integers(0, 99))
    def unpin(self, pick: int) -> None:
        k = sorted(+self.pinned)[pick % len(+self.pinned)]
        assert self.pins.unpin([k]) == []
        self.pinned[k] -= 1

    # ---- what must hold after every step ---------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        t = self.t
        assert t.slot_of == self.committed and t.pending == self.pending
        assert len(t.policy) == len(t.slot_of)
        assert t.busy.tolist() == [self.busy[s] for s in range(NUM_SLOTS)]
        assert all(t.busy[s] > 0 for s in t.doomed), "an idle doomed slot was not freed"
        in_use = [*t.slot_of.values(), *t.pending.values()]
        assert len(set(in_use)) == len(in_use), "a slot is in two places"
        assert not set(in_use) & t.doomed
        free = set(np.flatnonzero(t.alloc._is_free).tolist())
        assert free == set(range(NUM_SLOTS)) - set(in_use) - t.doomed, "a slot leaked or is used while free"
        assert t.alloc.free_count == self._free() == len(free)
        if self.DRAM:  # the native index of held keys says what the slot map says, key by key
            assert t.held(KEYS).tolist() == [k in t.slot_of for k in KEYS]


class DramSlotTable(SlotTableModel):
    DRAM = True


class SsdSlotTable(SlotTableModel):
    DRAM = False


TestDramSlotTable = DramSlotTable.TestCase
TestSsdSlotTable = SsdSlotTable.TestCase
TestDramSlotTable.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestSsdSlotTable.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
