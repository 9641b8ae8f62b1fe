"""Issue 13 item 4: distributed mode as README.md and docs/pool.md write it (`kvtier-pool --master ... --bind ...
--capacity`, no --block-bytes) registers with the master and serves engines; and "no pool reachable" is loud on the
engine side: a warning naming why, and counters in the pool tier's stats."""

from __future__ import annotations

import logging
import time

import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.client import MasterClient
from kvtier.store import TieredStore
from masterproc import MasterProcess
from poolproc import PoolProcess, until

BB = 16 << 10


def live_pools(m: MasterClient) -> dict[str, str]:
    return {n["node"]: n["address"] for n in m.nodes() if n["state"] == "live" and n["labels"].get("role") == "pool"}


def store_for(master: str, node_id: str, **extra) -> TieredStore:
    return TieredStore.from_config({"mode": "distributed", "master": master, "node_id": node_id,
                                    "dram_capacity": 64 * BB, "pool_timeout_ms": 1000, **extra}, BB)


def test_a_pool_started_as_the_readme_says_registers_and_serves_engines(tmp_path, make_keys):
    with MasterProcess(tmp_path, lease_s=5.0) as mp:
        with PoolProcess(tmp_path, capacity="8MiB", master=mp.endpoint, args=("--heartbeat-s", "0.2")) as pool:
            with MasterClient(mp.endpoint) as m:
                assert until(lambda: live_pools(m), timeout=10.0), "the pool never registered with the master"
                assert set(live_pools(m).values()) == {pool.tcp}
            keys = make_keys(40)
            with store_for(mp.endpoint, "engine-1") as writer:
                assert writer.put(keys, blocks_for(keys, BB)).stored == 40
                assert writer.flush(10.0)
                assert writer.stats()["offloads"]["pool"]["written"] == 40
            with store_for(mp.endpoint, "engine-2") as reader:
                assert until(lambda: reader.contains(keys) == [True] * 40, timeout=10.0)
                out = torch.empty(40, BB, dtype=torch.uint8)
                assert_all_hits_exact(reader.get(keys, out), out, blocks_for(keys, BB))


def test_no_pool_to_place_blocks_on_is_a_warning_and_a_counter(tmp_path, make_keys, caplog):
    with MasterProcess(tmp_path, lease_s=5.0) as mp:  # a master with no pool registered
        keys = make_keys(20)
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.pool"):
            with store_for(mp.endpoint, "engine-1") as store:
                store.put(keys, blocks_for(keys, BB))
                store.flush(10.0)
                extra = store.stats()["tiers"]["pool"]["extra"]
        assert extra["no_pool_blocks"] >= 20
        assert extra["no_pool"], "the stats do not say that no pool is reachable"
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "no pool" in text and "--master" in text, text


def test_every_listed_pool_down_is_a_warning_and_a_counter(tmp_path, make_keys, caplog):
    dead = "tcp://127.0.0.1:9"  # discard: nothing listens
    keys = make_keys(10)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.pool"):
        with TieredStore.from_config({"mode": "distributed", "pool": dead, "dram_capacity": 8 * BB,
                                      "pool_timeout_ms": 200, "pool_staging_bytes": 0}, BB) as store:
            for _ in range(3):
                store.put(keys, blocks_for(keys, BB))
                time.sleep(0.05)
            extra = store.stats()["tiers"]["pool"]["extra"]
    assert extra["no_pool_blocks"] >= 10 and extra["no_pool"]
    assert any("no pool" in r.getMessage() for r in caplog.records)


def test_a_full_pool_still_takes_new_blocks_through_the_master(tmp_path, make_keys):
    """A pool is a cache: full, it evicts to take new blocks, so the master's placement must still send it some
    (it used to count a full pool as having no room, and new blocks never reached a pool again)."""
    with MasterProcess(tmp_path, lease_s=5.0) as mp:
        with PoolProcess(tmp_path, capacity=str(64 * BB), master=mp.endpoint, args=("--heartbeat-s", "0.2")):
            with MasterClient(mp.endpoint) as m:
                assert until(lambda: live_pools(m), timeout=10.0)
                full = make_keys(64)
                with store_for(mp.endpoint, "engine-1", pool_staging_bytes=0) as writer:
                    assert writer.put(full, blocks_for(full, BB)).stored == 64
                    # The pool's heartbeat now reports it full.
                    assert until(lambda: any(t["used"] >= 64 * BB for n in m.nodes() for t in n["tiers"]
                                             if n["labels"].get("role") == "pool"), timeout=10.0)
                    later = make_keys(16, start=1000)
                    writer.put(later, blocks_for(later, BB))
                    assert writer.stats()["tiers"]["pool"]["extra"]["no_pool_blocks"] == 0
                with store_for(mp.endpoint, "engine-2") as reader:
                    out = torch.empty(16, BB, dtype=torch.uint8)
                    assert until(lambda: reader.get(later, out) == [True] * 16, timeout=10.0)
                    assert torch.equal(out, blocks_for(later, BB))
