"""``kvtier replay --pool``: a second node's DRAM (a real kvtier-pool process) under the replayed node's DRAM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvtier
from conftest import blocks_for
from kvtier.blocks import block_rows
from kvtier.tools.cli import main
from kvtier.tools.replay.sweep import build_store
from kvtier.transport import connect

SAMPLE = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc"
BASE = ["replay", str(SAMPLE), "--limit", "3", "--lanes", "2", "--hbm", "4GiB", "--dram", "5%",
        "--set", "pool_offload=on_evict", "--no-progress"]
BB = 4096


@pytest.mark.slow  # two replays with pool processes: ~10 s here
def test_a_pool_tier_extends_dram_and_runs_of_a_sweep_do_not_leak_into_each_other(tmp_path):
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
    # s3fifo ran after lru in the sweep: alone it measures exactly the same, so nothing of the lru run (blocks,
    # or the pool's eviction history) leaked into it.
    alone = tmp_path / "alone.json"
    assert main([*BASE, "--pool", "40%", "--policy", "s3fifo", "--json", str(alone)]) == 0
    fresh = json.loads(alone.read_text())["policies"]["s3fifo"]
    assert fresh["tier_hit_rate"] == with_pool["policies"]["s3fifo"]["tier_hit_rate"]


def first_evicted(endpoint: str, keys: list[bytes]) -> list[bytes]:
    """Fill a 4-block pool with keys[:4], read keys[0], put keys[4]: the keys the pool then lacks (LRU drops
    keys[1], FIFO keys[0])."""
    c = connect(endpoint, BB, timeout_s=10.0)
    try:
        data = blocks_for(keys, BB)
        assert c.put(keys[:4], block_rows(data[:4], 4, BB).ptrs) == [True] * 4
        out = torch.empty(1, BB, dtype=torch.uint8)
        assert c.get(keys[:1], block_rows(out, 1, BB, writable=True).ptrs) == [True]
        assert c.put(keys[4:5], block_rows(data[4:5], 1, BB).ptrs) == [True]
        return [k for k, held in zip(keys, c.contains(keys)) if not held]
    finally:
        c.close()


@pytest.mark.slow  # a replay bench: a pool per run
def test_each_run_gets_a_fresh_pool_evicting_by_the_runs_policy(make_keys):
    keys = make_keys(5)
    endpoints = []
    for policy, evicted in (("lru", 1), ("fifo", 0)):  # one sweep point, two policies
        with build_store(policy, {"dram_capacity": 2, "pool_capacity": 4}, {}, BB) as store:
            endpoint = store.tiers[1].route.endpoints()[0]
            endpoints.append(endpoint)
            assert first_evicted(endpoint, keys) == [keys[evicted]], policy
    assert endpoints[0] != endpoints[1]  # a fresh pool for the second run, not the first one emptied
