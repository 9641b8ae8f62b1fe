"""``kvtier replay --prefetch``: prefetch between turns modeled on the virtual clock (kvtier/replay/prefetch.py)
over the real store and SSD tier, on the shipped sample traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import main

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
    # LRU predicts nothing: a prefetch gets only free slots, and a full DRAM has none (negative control).
    assert runs["lru+pf"]["prefetch_blocks"]["prefetched"] == 0
    assert runs["lru+pf"]["hit_rate"] == runs["lru-pf"]["hit_rate"]
