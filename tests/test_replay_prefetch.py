"""``kvtier replay --prefetch``: prefetch between turns modeled on the virtual clock (kvtier/tools/replay/prefetch.py)
over the real store and SSD tier, on the shipped sample traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.tools.cli import main
from kvtier.tools.replay.prefetch import _Channel

SAMPLE = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc"


@pytest.mark.slow  # four replays with an SSD tier: ~30 s of CPU
def test_prefetch_puts_more_store_hits_in_dram_and_needs_a_predicting_policy(tmp_path):
    out = tmp_path / "pf.json"
    assert main(["replay", str(SAMPLE), "--limit", "6", "--lanes", "6", "--hbm", "4GiB", "--dram", "10%",
                 "--ssd", "30%", "--set", f"ssd_path={tmp_path}", "--policy", "default,lru",
                 "--prefetch", "on,off", "--no-progress", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["policies"]
    on, off = runs["default+pf"], runs["default-pf"]
    assert on["prefetch_blocks"]["prefetched"] > 0 and on["prefetch_blocks"]["used"] > 0
    assert off["prefetch_blocks"] == {}
    assert on["dram_share_of_store_hits"] > off["dram_share_of_store_hits"]
    assert on["hit_rate"] >= off["hit_rate"] - 0.005
    assert on["hit_rate"] <= on["opt_hit_rate"]
    # Of the blocks prefetched, each was used, wasted, or is still in DRAM waiting: never more than prefetched.
    b = on["prefetch_blocks"]
    assert b["used"] + b["wasted"] <= b["prefetched"]
    assert on["prefetch_bytes"]["prefetched"] == b["prefetched"] * 8 * 2**20
    # A prefetch's bytes occupy its tier's channel: the seconds they took at the SSD's bandwidth, with the
    # seconds demand loads held it, fit in the replay's span (a prefetch only spends what demand left free).
    ch = on["channel_s"]["ssd"]
    assert ch["prefetch"] == pytest.approx(b["from_ssd"] * 8 * 2**20 / 6e9)
    assert ch["demand"] > 0 and 0 < ch["busy_share"] <= 1 + 1e-9
    assert off["channel_s"] == {}
    # LRU predicts nothing: a prefetch gets only free slots, and a full DRAM has none (negative control).
    assert runs["lru+pf"]["prefetch_blocks"]["prefetched"] == 0
    assert runs["lru+pf"]["hit_rate"] == runs["lru-pf"]["hit_rate"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.floats(0, 3)), max_size=12),
       st.lists(st.floats(0, 40), min_size=1, max_size=12))
def test_a_channel_counts_as_free_exactly_the_time_no_demand_load_held_it(loads, events):
    """Demand loads on the link one after another (each starts at or after the previous one's end, as the
    replay's FIFO link makes them), registered before the events that count free time: the free time counted
    up to each event plus the demand time inside [0, event] is the event's time, never more (a prefetch could
    otherwise use time a demand load held)."""
    ch = _Channel(1.0)
    t, intervals = 0.0, []
    for gap, seconds in loads:
        start = t + gap
        intervals.append((start, start + seconds))
        ch.busy.append((start, start + seconds))
        t = start + seconds
    free = 0.0
    for now in sorted(events):
        free += ch.free(now)
        held = sum(max(0.0, min(end, now) - start) for start, end in intervals if start < now)
        assert free + held == pytest.approx(now, abs=1e-6)
