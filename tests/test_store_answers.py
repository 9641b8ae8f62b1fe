"""What connectors and tools ask of a store, answered by the store from what its tiers declare
(kvtier/tiers/base.py), not by reaching into a tier's stats: ``capacity_blocks``, ``pinned_memory``,
``local_tiers`` and ``local_keys``."""

from __future__ import annotations

import torch

from conftest import blocks_for
from kvtier import TieredStore
from kvtier.pool.process import PoolDaemon

BB = 4096


def test_an_embedded_store_answers_its_capacity_memory_and_local_keys(tmp_path, make_keys):
    config = {"dram_capacity": 8 * BB, "ssd_path": str(tmp_path / "ssd"), "ssd_capacity": 64 * BB,
              "ssd_offload": "write_through"}
    with TieredStore.from_config(config, BB) as store:
        assert store.capacity_blocks == 8
        assert store.pinned_memory is False  # no GPU here: the DRAM buffer is not page-locked
        assert [t.name for t in store.local_tiers] == ["dram", "ssd"]
        keys = make_keys(20)
        for a in range(0, len(keys), 4):  # a put holds at most DRAM's 8 blocks: the earlier batches go down
            assert store.put(keys[a:a + 4], blocks_for(keys[a:a + 4], BB)).stored == 4
        assert store.tiers[1].flush(10)
        # write-through: the first keys are on the SSD only, the last ones in both tiers; each is listed once
        listed = store.local_keys()
        assert len(listed) == len(set(listed)) and set(listed) == set(keys)
        store.remove(listed)
        assert store.local_keys() == [] and not any(store.contains(keys))


def test_a_standalone_store_counts_the_node_pool_as_neither_local_nor_listed():
    with PoolDaemon(32 * BB, BB, ipc=True) as pool:
        config = {"mode": "standalone", "pool": pool.endpoint("ipc"), "standalone_dram_capacity": 0}
        with TieredStore.from_config(config, BB) as store:
            assert [t.name for t in store.tiers] == ["pool"]
            assert store.local_tiers == [] and store.pinned_memory is False
            assert store.capacity_blocks == 32
            keys = [bytes([i]) * 16 for i in range(4)]
            assert store.put(keys, torch.zeros(4, BB, dtype=torch.uint8)).stored == 4
            assert store.local_keys() == []  # the pool reports its blocks itself
