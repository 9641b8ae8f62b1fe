"""Extension points used from outside kvtier: a module under tests/ registers its own offload policy and its own pool
transport, and stores built by ``TieredStore.from_config`` put, evict and get through them, with no edit under
kvtier/ or pool/ (a pool offers the transport because its table lists it)."""

from __future__ import annotations

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
from kvtier.config import Config, ConfigError
from kvtier.offload import OffloadPolicy, known_offloads, register_offload
from kvtier.pool.process import PoolDaemon
from kvtier.pool.server import PoolServer
from kvtier.pool.state import PoolSettings
from kvtier.transport import PoolRefused, Transport, connect, register_transport
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
