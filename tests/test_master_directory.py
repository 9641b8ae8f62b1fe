"""KeyTable and Directory against plain-dict models: batch find/insert/delete through growth and tombstone
rehashes; placements, prefix counts, retirement and sweeping; heat decay; snapshot export/restore."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.master.directory import Directory, location_words, mask_locations
from kvtier.master.heat import HeatClock
from kvtier.keys.table import KeyTable, as_key_array, key_bytes
from kvtier.keys import Namespace

POOL = as_key_array(b"".join(Namespace("dir").keys(range(600))))
# Structured keys too: zeros, counters, one word varying (a client may send anything 16 bytes long).
STRUCTURED = np.array([[i, 0] for i in range(40)] + [[0, i] for i in range(1, 40)], np.uint64)
ALL = np.concatenate([POOL, STRUCTURED])


def rows(idx):
    return ALL[np.asarray(idx, np.int64)]


class TableModel(RuleBasedStateMachine):
    """Random batches (with duplicates) of insert/delete against a set; small start capacity forces growth
    and, with many deletes, tombstone rehashes."""

    native = True

    def __init__(self):
        super().__init__()
        self.table = KeyTable(16, native=self.native)
        self.table.add_column("v", lambda c: np.zeros(c, np.int64))
        self.model: dict[bytes, int] = {}

    @rule(idx=st.lists(st.integers(0, len(ALL) - 1), max_size=80))
    def insert(self, idx):
        q = rows(idx)
        slots, is_new = self.table.insert(q)
        v = self.table.column("v")
        for i, k in enumerate(key_bytes(q)):
            assert slots[i] >= 0
            assert is_new[i] == (k not in self.model and k not in key_bytes(q[:i]))
        for i, k in enumerate(key_bytes(q)):
            if k not in self.model:
                self.model[k] = int(idx[i]) + 1
                v[slots[i]] = int(idx[i]) + 1

    @rule(idx=st.lists(st.integers(0, len(ALL) - 1), max_size=80))
    def delete(self, idx):
        q = rows(idx)
        self.table.delete(self.table.find(q))
        for k in key_bytes(q):
            self.model.pop(k, None)

    @invariant()
    def agrees(self):
        slots = self.table.find(ALL)
        v = self.table.column("v")
        for k, s in zip(key_bytes(ALL), slots):
            if k in self.model:
                assert s >= 0 and v[s] == self.model[k], "a key lost its slot or its column value"
            else:
                assert s == -1
        assert self.table.live == len(self.model)


class NumpyTableModel(TableModel):
    native = False  # the fallback path when the native library is not built


TestTable = TableModel.TestCase
TestTable.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestNumpyTable = NumpyTableModel.TestCase
TestNumpyTable.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_native_and_numpy_probes_agree_slot_for_slot():
    if KeyTable().native is None:
        pytest.skip("the native CPU library is not built")
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**63, size=(30_000, 2), dtype=np.uint64)
    tables = [KeyTable(native=True), KeyTable(native=False)]
    for t in tables:
        t.insert(keys[:20_000])
        t.delete(t.find(keys[:5_000]))
        t.insert(keys[20_000:])
    q = np.concatenate([keys[::7], rng.integers(0, 2**63, size=(500, 2), dtype=np.uint64)])
    # Batch inserts may lay keys out differently (numpy places a batch in parallel rounds), but both tables
    # must hold the same keys, and every slot found must hold the key asked for.
    found = [t.find(q) for t in tables]
    assert np.array_equal(found[0] >= 0, found[1] >= 0)
    assert (found[0] >= 0).sum() == len(keys[::7]) - len(keys[:5_000:7])
    for t, slots in zip(tables, found):
        hit = slots >= 0
        assert np.array_equal(t.k0[slots[hit]], q[hit, 0]) and np.array_equal(t.k1[slots[hit]], q[hit, 1])
    # Tables built by one path are read correctly by the other.
    tables[1].native = tables[0].native
    assert np.array_equal(tables[1].find(q), found[1])


def test_table_grows_and_keeps_load_bounded():
    t = KeyTable()
    q = as_key_array(b"".join(Namespace("grow").keys(range(20_000))))
    t.insert(q)
    assert t.live == 20_000 and t.capacity >= 20_000 / 0.7
    assert (t.find(q) >= 0).all()
    t.delete(t.find(q[:15_000]))
    assert (t.find(q[:15_000]) == -1).all() and (t.find(q[15_000:]) >= 0).all()
    assert t.tombstones <= t.capacity // 4  # deletes past a quarter rehash in place


def test_as_key_array_rejects_ragged_blobs():
    with pytest.raises(ValueError, match="multiple of 16"):
        as_key_array(b"x" * 17)


class DirectoryModel(RuleBasedStateMachine):
    """Placements of 6 locations over 50 keys against a dict key -> set(locations); dead locations are
    retired and swept in small chunks while other changes keep happening."""

    KEYS = POOL[:50]

    def __init__(self):
        super().__init__()
        self.d = Directory(HeatClock(60.0, 0.0))
        self.d.ensure_locations(6)
        self.model: dict[bytes, set[int]] = {}
        self.dead: set[int] = set()
        self.freed: set[int] = set()

    def live(self):
        return location_words([loc for loc in range(6) if loc not in self.dead], self.d.words)

    @rule(loc=st.integers(0, 5), idx=st.lists(st.integers(0, 49), max_size=20))
    def add(self, loc, idx):
        if loc in self.dead:
            return  # nobody adds to a retired location
        q = self.KEYS[np.asarray(idx, np.int64)]
        fresh = {k for k in key_bytes(q) if loc not in self.model.get(k, set())}
        assert self.d.add(loc, q, 4096, 1.0) == len(fresh)
        for k in key_bytes(q):
            self.model.setdefault(k, set()).add(loc)

    @rule(loc=st.integers(0, 5), idx=st.lists(st.integers(0, 49), max_size=20))
    def remove(self, loc, idx):
        if loc in self.dead:
            return
        q = self.KEYS[np.asarray(idx, np.int64)]
        self.d.remove(loc, q)
        for k in key_bytes(q):
            if k in self.model:
                self.model[k].discard(loc)

    @rule(loc=st.integers(0, 5))
    def kill(self, loc):
        if loc not in self.dead:
            self.dead.add(loc)
            self.d.retire([loc])

    @rule(budget=st.integers(1, 3000))
    def sweep(self, budget):
        for loc in self.d.sweep(budget):
            assert loc in self.dead
            self.freed.add(loc)

    @invariant()
    def answers_match(self):
        slots, m = self.d.masks(self.KEYS, self.live())
        for k, s, row in zip(key_bytes(self.KEYS), slots, m):
            want = self.model.get(k, set()) - self.dead
            assert set(mask_locations(row)) == want
        # An entry exists while a live or not-yet-swept location holds it.
        for k, s in zip(key_bytes(self.KEYS), slots):
            if self.model.get(k, set()) - self.dead:
                assert s >= 0

    @invariant()
    def freed_locations_are_clean(self):
        slots, m = self.d.masks(self.KEYS, location_words(sorted(self.freed), self.d.words))
        assert not m.any(), "a location was handed back while bits of it remained"


TestDirectory = DirectoryModel.TestCase
TestDirectory.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@given(st.lists(st.sets(st.integers(0, 9), max_size=4), max_size=40))
@settings(max_examples=150, deadline=None)
def test_prefix_counts_match_a_naive_scan(holders):
    m = np.stack([location_words(sorted(h), 1) for h in holders]) if holders else np.zeros((0, 1), np.uint64)
    pc = Directory.prefix_counts(m)
    any_len = next((i for i, h in enumerate(holders) if not h), len(holders))
    assert pc.any == any_len
    for loc in range(10):
        n = next((i for i, h in enumerate(holders) if loc not in h), len(holders))
        assert pc.by_location.get(loc, 0) == n


def test_masks_widen_past_64_locations():
    d = Directory(HeatClock(60.0, 0.0))
    q = POOL[:10]
    d.add(3, q, 1, 0.0)
    d.ensure_locations(130)
    d.add(129, q[:5], 1, 0.0)
    _, m = d.masks(q, location_words([3, 129], d.words))
    assert d.words == 3
    assert [mask_locations(r) for r in m] == [[3, 129]] * 5 + [[3]] * 5


def test_heat_decays_by_half_life_and_survives_renormalization():
    clock = HeatClock(10.0, 0.0)
    d = Directory(clock)
    q = POOL[:3]
    d.add(0, q, 1, 0.0)
    slots, _ = d.masks(q, location_words([0], 1))
    d.touch(slots[:1], 0.0)
    d.touch(slots[:2], 10.0)
    count, heat, last = d.heat(q, 10.0)
    assert count.tolist() == [2, 1, 0] and last.tolist()[:2] == [10, 10]
    assert heat[0] == pytest.approx(1.5) and heat[1] == pytest.approx(1.0) and heat[2] == 0
    # 700 half-lives later the clock has renormalized (scores would overflow float32 otherwise).
    d.touch(slots[1:2], 7010.0)
    assert clock.t0 == 7010.0
    count, heat, _ = d.heat(q, 7020.0)
    assert count.tolist() == [2, 2, 0] and heat[1] == pytest.approx(0.5, rel=1e-4) and heat[0] < 1e-30
    keys, h, c, _ = d.top(2, 7020.0)
    assert key_bytes(keys)[0] == key_bytes(q[1:2])[0] and c[0] == 2


def test_export_restore_round_trip():
    d = Directory(HeatClock(60.0, 0.0))
    d.add(1, POOL[:100], 8192, 5.0)
    d.add(2, POOL[50:150], 8192, 5.0)
    slots, _ = d.masks(POOL[:10], location_words([1], 1))
    d.touch(slots, 6.0)
    e = Directory(HeatClock(60.0, 0.0))
    e.restore(d.export())
    live = location_words([1, 2], 1)
    assert np.array_equal(d.masks(POOL[:200], live)[1], e.masks(POOL[:200], live)[1])
    assert [a.tolist() for a in d.heat(POOL[:20], 7.0)] == [a.tolist() for a in e.heat(POOL[:20], 7.0)]
    assert len(e) == 150 and (e.block_bytes(e.masks(POOL[:1], live)[0]) == 8192).all()


def test_heat_asked_for_a_time_before_the_clock_epoch_is_the_heat_at_the_epoch_not_an_overflow():
    """A wall clock stepped back (or a shared log whose entries carry a clock ahead of this master's) asks for
    heat long before the epoch t0: 2^((t0 - now) / half_life) overflows a float there (an OverflowError out of
    every heat, top and cost answer). Answered as at the epoch, and unchanged for times after it."""
    clock = HeatClock(600.0, t0=2e6)
    scores = np.array([1.0, 8.0], np.float32)
    assert clock.heat(scores, 1e6).tolist() == [1.0, 8.0]  # ~1,667 half-lives before t0
    assert clock.heat(scores, 2e6 + 600.0).tolist() == [0.5, 4.0]
