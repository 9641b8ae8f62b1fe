"""LocationTable (master/locations.py): the numbering of directory-mask bits the node registry hands out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.master.locations import LocationTable
from kvtier.wire import WireError


def test_numbers_lowest_swept_first_and_never_an_unswept_one():
    t = LocationTable(limit=8)
    assert t.number("a", ["dram", "ssd"], None) == {"dram": 0, "ssd": 1}
    assert t.number("b", ["dram"], None) == {"dram": 2}
    t.retire([0, 1])
    assert (t.owner(0), t.owner(2), t.owner(99)) == (None, ("b", "dram"), None)
    assert t.number("c", ["dram"], None) == {"dram": 3}, "0 and 1 are retired, not swept: never reused yet"
    t.release([1, 0, 2])  # 2 is owned: not freed
    assert t.number("d", ["x", "y"], None) == {"x": 0, "y": 1}
    assert t.count == 4


def test_the_limit_counts_held_numbers_and_reclaims_the_sweep_when_short():
    t = LocationTable(limit=3)
    t.number("a", ["1", "2", "3"], None)
    with pytest.raises(WireError) as e:
        t.number("b", ["1"], None)
    assert e.value.code == wire.ERR_TOO_LARGE and "3 of the master's 3 are held" in e.value.message
    t.retire([0, 1])
    swept = []
    assert t.number("b", ["1", "2"], lambda: swept.append(1) or [0, 1]) == {"1": 0, "2": 1}
    assert swept == [1], "the sweep was finished because no number was free"


def test_adopt_orphans_retires_unowned_present_bits_and_frees_the_rest():
    t = LocationTable(limit=16)
    t.set_owner(5, ("n", "dram"))
    assert t.adopt_orphans(present=[2, 5], owned={5}) == [2]
    assert t.number("m", ["a", "b", "c"], None) == {"a": 0, "b": 1, "c": 3}, "2 waits for its sweep"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["number", "retire", "release"]), st.integers(1, 3)), max_size=40))
def test_no_number_is_held_twice(ops):
    t = LocationTable(limit=6)
    held: dict[int, tuple[str, str]] = {}
    retired: list[int] = []
    for i, (op, n) in enumerate(ops):
        if op == "number":
            try:
                got = t.number(f"n{i}", [str(k) for k in range(n)], None)
            except WireError:
                assert len(held) + n > 6
                continue
            assert not set(got.values()) & set(held) and not set(got.values()) & set(retired)
            held.update({loc: (f"n{i}", tier) for tier, loc in got.items()})
        elif op == "retire" and held:
            locs = sorted(held)[:n]
            t.retire(locs)
            retired += locs
            for loc in locs:
                del held[loc]
        elif op == "release":
            t.release(retired)
            retired = []
        assert all(t.owner(loc) == owner for loc, owner in held.items())
