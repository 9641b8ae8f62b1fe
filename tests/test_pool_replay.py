"""``kvtier replay --pool``: a second node's DRAM (a real kvtier-pool process) under the replayed node's DRAM."""

from __future__ import annotations

import json
from pathlib import Path

import kvtier
from kvtier.cli import main

SAMPLE = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc"
BASE = ["replay", str(SAMPLE), "--limit", "3", "--lanes", "2", "--hbm", "4GiB", "--dram", "5%",
        "--set", "pool_offload=on_evict", "--no-progress"]


def test_a_pool_tier_extends_dram_and_one_pool_serves_a_sweep_without_leaks(tmp_path):
    out = tmp_path / "pool.json"
    assert main([*BASE, "--pool", "0,40%", "--policy", "lru,s3fifo", "--json", str(out)]) == 0
    without, with_pool = json.loads(out.read_text())["points"]
    assert with_pool["capacities"]["pool"]["label"].startswith("40%") and without["capacities"]["pool"]["blocks"] == 0
    for policy in ("lru", "s3fifo"):
        a, b = without["policies"][policy], with_pool["policies"][policy]
        assert a["tier_hit_rate"].get("pool", 0) == 0 and b["tier_hit_rate"]["pool"] > 0
        assert b["hit_rate"] > a["hit_rate"]
        assert b["hit_rate"] <= b["opt_hit_rate"] <= b["infinite_hit_rate"]
        assert b["bytes_loaded"]["pool"] == b["tokens"]["hit"]["pool"] // 64 * 8 * 2**20
    # s3fifo ran second on the same pool process (emptied between runs): alone, on a fresh pool, it measures
    # exactly the same, so no block of the lru run leaked into it.
    alone = tmp_path / "alone.json"
    assert main([*BASE, "--pool", "40%", "--policy", "s3fifo", "--json", str(alone)]) == 0
    fresh = json.loads(alone.read_text())["policies"]["s3fifo"]
    assert fresh["tier_hit_rate"] == with_pool["policies"]["s3fifo"]["tier_hit_rate"]
