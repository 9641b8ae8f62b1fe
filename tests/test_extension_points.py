"""Extension points used from outside kvtier: a module under tests/ registers its own tier, its own offload policy
and its own pool transport, and stores built by ``TieredStore.from_config`` put, evict and get through them, alone
and all three together, with no edit under kvtier/ or pool/ (a pool offers the transport because its table lists
it; the tier takes its settings from the config's ``tiers`` key, checked at load)."""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import TieredStore
from kvtier.blocks import block_rows
from kvtier.config import Config, ConfigError
from kvtier.offload import OffloadPolicy, known_offloads, register_offload
from kvtier.pool.process import PoolDaemon
from kvtier.pool.server import PoolServer
from kvtier.pool.state import PoolSettings
from kvtier.settings import ConfigError as SettingsError
from kvtier.settings.tiers import StackedTier, TierBlock, TierSpec, register_tier
from kvtier.tiers.base import TierStats
from kvtier.transport import PoolRefused, Transport, connect, register_transport
from kvtier.transport.tcp import TcpConnection

BB = 4096


class DictTier:
    """A tier of whole blocks in a dict, refusing puts when full (it evicts nothing): enough of the Tier protocol
    (kvtier/tiers/base.py) for the store to offload into it, promote out of it and remove from it."""

    name = "test_dict"

    def __init__(self, block_bytes: int, capacity_blocks: int) -> None:
        self.block_bytes, self.capacity = block_bytes, capacity_blocks
        self.blocks: dict[bytes, bytes] = {}
        self.stat = TierStats(self.name, capacity_blocks * block_bytes, 0, 0)
        self.closed = False

    def contains(self, keys):
        return [k in self.blocks for k in keys]

    def put(self, keys, blocks):
        rows = block_rows(blocks, len(keys), self.block_bytes)
        held = []
        for k, ptr in zip(keys, rows.ptrs):
            if k not in self.blocks and len(self.blocks) < self.capacity:
                self.blocks[k] = ctypes.string_at(int(ptr), self.block_bytes)
                self.stat.puts += 1
            held.append(k in self.blocks)
        return held

    def get(self, keys, out):
        rows = block_rows(out, len(keys), self.block_bytes, writable=True)
        hit = []
        for k, ptr in zip(keys, rows.ptrs):
            data = self.blocks.get(k)
            if data is not None:
                ctypes.memmove(int(ptr), data, self.block_bytes)
            hit.append(data is not None)
        self.stat.hits += sum(hit)
        self.stat.misses += len(hit) - sum(hit)
        return hit

    def remove(self, keys):
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def attach(self, pins, on_evict):
        pass  # it never evicts

    def stats(self):
        self.stat.blocks, self.stat.used_bytes = len(self.blocks), len(self.blocks) * self.block_bytes
        return self.stat

    def close(self):
        self.closed = True


def _check_dict_tier(section) -> None:
    if set(section) - {"capacity_blocks", "offload"}:
        raise SettingsError(f"unknown keys {sorted(set(section) - {'capacity_blocks', 'offload'})}")
    if not isinstance(section.get("capacity_blocks"), int) or section["capacity_blocks"] < 1:
        raise SettingsError(f"capacity_blocks must be an integer >= 1, got {section.get('capacity_blocks')!r}")


BUILT: list[DictTier] = []


def _build_dict_tier(cfg, section, block: TierBlock) -> StackedTier | None:
    tier = DictTier(block.block_bytes, section["capacity_blocks"])
    BUILT.append(tier)
    return StackedTier(tier, offload=section.get("offload", "on_evict"), promote=True)


# Below the SSD (order 200), built wherever the config names it under "tiers".
register_tier(TierSpec("test_dict", 300, _build_dict_tier, check=_check_dict_tier))


def test_a_registered_tier_is_stacked_from_its_settings_and_blocks_go_through_it(make_keys):
    config = {"dram_capacity": 8 * BB, "tiers": {"test_dict": {"capacity_blocks": 64}}}
    with TieredStore.from_config(config, BB) as store:
        tier = BUILT[-1]
        assert [t.name for t in store.tiers] == ["dram", "test_dict"] and store.tiers[1] is tier
        keys = make_keys(32)
        for a in range(0, 32, 4):  # DRAM holds 8: the earlier batches are evicted into the registered tier
            assert store.put(keys[a:a + 4], blocks_for(keys[a:a + 4], BB)).stored == 4
        evicted = [k for k in keys if not store.tiers[0].contains([k])[0]]
        assert len(evicted) >= 24 and all(tier.contains(evicted))
        out = torch.zeros(len(keys), BB, dtype=torch.uint8)
        assert_all_hits_exact(store.get(keys, out), out, blocks_for(keys, BB))
        assert tier.stats().hits >= 24
        assert store.remove(keys[:4]) >= 4 and not any(tier.contains(keys[:4]))
    assert tier.closed, "the store did not close the registered tier"


def _build_broken(cfg, section, block):
    raise RuntimeError("the broken tier cannot open")


register_tier(TierSpec("test_broken", 400, _build_broken, check=lambda section: None))


def test_a_tier_that_fails_to_build_closes_the_tiers_built_before_it():
    config = {"dram_capacity": 8 * BB, "tiers": {"test_dict": {"capacity_blocks": 4}, "test_broken": {}}}
    with pytest.raises(RuntimeError, match="the broken tier cannot open"):
        TieredStore.from_config(config, BB)
    assert BUILT[-1].closed


def test_a_registered_tiers_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"tiers: test_dict: capacity_blocks must be an integer >= 1, got 0"):
        Config.load({"tiers": {"test_dict": {"capacity_blocks": 0}}}, environ={})
    with pytest.raises(ConfigError, match=r"tiers: 'test_nope' is not a registered tier; registered: test_dict"):
        Config.load({"tiers": {"test_nope": {}}}, environ={})
    with pytest.raises(ConfigError, match=r"tiers: 'ssd' is a built-in tier, set by its own keys"):
        Config.load({"tiers": {"ssd": {}}}, environ={})
    loaded = Config.load({}, environ={"KVTIER_TIERS": '{"test_dict": {"capacity_blocks": 3}}'})
    assert loaded.tiers == {"test_dict": {"capacity_blocks": 3}}


@register_offload("test_even_keys")
class EvenKeysOnly(OffloadPolicy):
    """Writes down, on eviction, only the blocks whose key starts with an even byte."""

    when = "on eviction, even keys only"

    def __init__(self) -> None:
        self.asked = 0

    def due(self, keys: Sequence[bytes], lacking: Sequence[int], seen: Callable[[], list[int]]) -> list[int]:
        self.asked += 1
        return [i for i in lacking if keys[i][0] % 2 == 0]


def test_a_registered_offload_policy_is_a_config_value_and_decides_what_goes_down(tmp_path, make_keys):
    assert "test_even_keys" in known_offloads()
    config = {"dram_capacity": 8 * BB, "ssd_path": str(tmp_path), "ssd_capacity": 64 * BB,
              "ssd_offload": "test_even_keys", "ssd_promote": False}
    with TieredStore.from_config(config, BB) as store:
        assert store.stats()["offload"]["policy"] == "test_even_keys"
        keys = make_keys(32)
        for a in range(0, 32, 4):  # DRAM holds 8: the earlier batches are evicted, and the policy chooses
            assert store.put(keys[a:a + 4], blocks_for(keys[a:a + 4], BB)).stored == 4
        assert store.tiers[1].flush(10)
        evicted = [k for k in keys if not store.tiers[0].contains([k])[0]]
        on_ssd = set(k for k, h in zip(evicted, store.tiers[1].contains(evicted)) if h)
        assert evicted and on_ssd == {k for k in evicted if k[0] % 2 == 0}
        assert store._offloads[0].policy.asked > 0
        want = sorted(on_ssd)
        out = torch.zeros(len(want), BB, dtype=torch.uint8)
        assert_all_hits_exact(store.get(want, out), out, blocks_for(want, BB))


def test_an_unregistered_offload_policy_is_refused_at_load_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"ssd_offload: 'test_nope' is not one of .*on_evict.*test_even_keys"):
        Config.from_dict({"ssd_path": "/nvme/x", "ssd_offload": "test_nope"})


class CountedFrames(TcpConnection):
    """Block bytes in zmq frames (tcp.py), counting the calls that move them."""

    transport = "test_counted"
    calls: dict[str, int] = {"put": 0, "get": 0}

    def put(self, keys, rows):
        CountedFrames.calls["put"] += 1
        return super().put(keys, rows)

    def get(self, keys, rows):
        CountedFrames.calls["get"] += 1
        return super().get(keys, rows)


# Its own offer, carried by the pool's zmq frames (the service tcp rides): a pool lists "test_counted" in its hello
# only where its table has this registration, i.e. in a process that imported this module.
register_transport(Transport("test_counted", f"{__name__}:CountedFrames", offer="test_counted",
                             pool_service="frames"))


@contextmanager
def pool_in_this_process(tmp_path: Path, capacity: int) -> Iterator[str]:
    """A real pool (pool/server.py's PoolServer, on an ipc:// endpoint) on a thread of this process, whose table
    of transports has test_counted; its endpoint."""
    ready = tmp_path / "pool.ready"
    settings = PoolSettings(bind=(f"ipc://{tmp_path}/pool.sock",), capacity=capacity, block_bytes=BB,
                            shm_dir=str(tmp_path), rdma="off", stream="off", client_share=1.0)
    server = PoolServer(settings, ready_file=str(ready))
    thread = threading.Thread(target=server.run, name="test-pool", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert thread.is_alive() and time.monotonic() < deadline, "the pool did not start"
            time.sleep(0.01)
        yield json.loads(ready.read_text())["endpoints"][0]
    finally:
        server.stop()
        thread.join(10)
    assert not thread.is_alive(), "the pool did not stop"


def test_a_pool_offers_a_registered_transport_from_its_table(tmp_path):
    with pool_in_this_process(tmp_path, 16 * BB) as endpoint:
        conn = connect(endpoint, BB, transport="test_counted", timeout_s=10.0)
        try:
            assert isinstance(conn, CountedFrames)
            assert conn.info.transports["test_counted"] == {} == conn.info.transports["tcp"]
            assert list(conn.info.transports) == ["tcp", "test_counted", "shm"]  # by service, the table's order
        finally:
            conn.close()


def test_a_pool_whose_table_lacks_a_transport_does_not_offer_it():
    """A kvtier-pool process never imported this module: it offers what its own table lists, not test_counted."""
    with PoolDaemon(16 * BB, BB, ipc=True) as pool:
        endpoint = pool.endpoint("ipc")
        conn = connect(endpoint, BB, transport="tcp", timeout_s=10.0)
        try:
            assert sorted(conn.info.transports) == ["shm", "stream", "tcp"]
        finally:
            conn.close()
        with pytest.raises(PoolRefused, match="the pool does not offer 'test_counted'"):
            connect(endpoint, BB, transport="test_counted", timeout_s=10.0)


def test_a_registered_transport_is_a_config_value_and_moves_the_blocks(make_keys, tmp_path):
    with pool_in_this_process(tmp_path, 16 * BB) as endpoint:
        config = {"mode": "standalone", "pool": endpoint, "standalone_dram_capacity": 0,
                  "pool_transport": "test_counted"}
        with TieredStore.from_config(config, BB) as store:
            keys = make_keys(24)
            for a in range(0, 24, 4):  # the pool holds 16: the first blocks are evicted there
                assert store.put(keys[a:a + 4], blocks_for(keys[a:a + 4], BB)).stored == 4
            assert CountedFrames.calls["put"] >= 6
            recent = keys[-8:]
            out = torch.zeros(len(recent), BB, dtype=torch.uint8)
            assert_all_hits_exact(store.get(recent, out), out, blocks_for(recent, BB))
            assert CountedFrames.calls["get"] >= 1
            assert not all(store.contains(keys[:8])), "the pool evicted nothing"


def test_an_unregistered_transport_is_refused_at_load_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"pool_transport: 'test_nope' is not one of auto, .*test_counted"):
        Config.from_dict({"mode": "standalone", "pool": "ipc:///p.sock", "pool_transport": "test_nope"})


def test_a_registered_tier_offload_policy_and_transport_together(make_keys, tmp_path):
    """One store over all three: private DRAM, a pool reached over the registered transport, and the registered tier
    below it, fed by the registered offload policy (only even keys go down to it)."""
    with pool_in_this_process(tmp_path, 64 * BB) as endpoint:
        config = {"mode": "standalone", "pool": endpoint, "standalone_dram_capacity": 8 * BB,
                  "pool_transport": "test_counted", "pool_offload": "on_evict",
                  "tiers": {"test_dict": {"capacity_blocks": 64, "offload": "test_even_keys"}}}
        before = dict(CountedFrames.calls)
        with TieredStore.from_config(config, BB) as store:
            tier = BUILT[-1]
            assert [t.name for t in store.tiers] == ["dram", "pool", "test_dict"]
            assert [o.policy.name for o in store._offloads] == ["on_evict", "test_even_keys"]
            keys = make_keys(32)
            for a in range(0, 32, 4):
                assert store.put(keys[a:a + 4], blocks_for(keys[a:a + 4], BB)).stored == 4
            store.tiers[1].flush(10)
            evicted = [k for k in keys if not store.tiers[0].contains([k])[0]]
            assert evicted and set(k for k in evicted if tier.contains([k])[0]) == {k for k in evicted if k[0] % 2 == 0}
            assert CountedFrames.calls["put"] > before["put"], "nothing went to the pool over the registered transport"
            out = torch.zeros(len(keys), BB, dtype=torch.uint8)
            assert_all_hits_exact(store.get(keys, out), out, blocks_for(keys, BB))
            assert store.tiers[1].flush(10)  # the get's promotions evicted blocks that are still on their way down
            store.remove(keys)
            assert not any(store.contains(keys))
