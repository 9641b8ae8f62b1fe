"""Extension points used from outside kvtier: a module under tests/ registers its own offload policy and its own pool
transport, and stores built by ``TieredStore.from_config`` put, evict and get through them, with no edit under
kvtier/."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import TieredStore
from kvtier.config import Config, ConfigError
from kvtier.offload import OffloadPolicy, known_offloads, register_offload
from kvtier.pool.process import PoolDaemon
from kvtier.transport import Transport, register_transport
from kvtier.transport.tcp import TcpConnection

BB = 4096


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


register_transport(Transport("test_counted", f"{__name__}:CountedFrames", offer="tcp"))


def test_a_registered_transport_is_a_config_value_and_moves_the_blocks(make_keys):
    with PoolDaemon(16 * BB, BB, ipc=True) as pool:
        config = {"mode": "standalone", "pool": pool.endpoint("ipc"), "standalone_dram_capacity": 0,
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
