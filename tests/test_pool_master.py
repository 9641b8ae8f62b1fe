"""Pools with kvtier-master: pools register (labelled role=pool) and publish what they hold; a distributed
store places puts by the master's route_put and gets from the node the master's directory names; a pool
that shuts down says goodbye and its blocks vanish from answers at once."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.client import MasterClient, api
from kvtier.store import TieredStore
from kvtier.transport import connect
from masterproc import MasterProcess
from poolproc import PoolProcess, until

BB = 16 << 10


@pytest.fixture
def cluster(tmp_path):
    with MasterProcess(tmp_path, lease_s=5.0) as mp:
        opts = {"capacity": "64MiB", "block_bytes": BB, "master": mp.endpoint, "args": ("--heartbeat-s", "0.2")}
        with PoolProcess(tmp_path, name="pa", **opts) as a, PoolProcess(tmp_path, name="pb", **opts) as b:
            with MasterClient(mp.endpoint) as m:
                assert until(lambda: len(live_pools(m)) == 2)  # registered at start: their block size is known
                yield mp, m, a, b


def live_pools(m: MasterClient) -> dict[str, str]:
    return {n["node"]: n["address"] for n in m.nodes() if n["state"] == "live" and n["labels"].get("role") == "pool"}


def store_for(master: str, node_id: str, **extra) -> TieredStore:
    return TieredStore.from_config({"mode": "distributed", "master": master, "node_id": node_id,
                                    "dram_capacity": 64 * BB, "pool_timeout_ms": 500, **extra}, BB)


def test_puts_follow_route_put_and_gets_follow_the_directory(cluster, make_keys):
    mp, m, a, b = cluster
    # An engine node (no role label, lots of room) must never be a target.
    m.call(api.register("engine-x", "inc", 0, [("dram", 1 << 40)]))
    m.call(api.inventory("engine-x", "inc", 0, 0, True, {}, {}))
    keys = make_keys(60)
    with store_for(mp.endpoint, "engine-1") as writer, store_for(mp.endpoint, "engine-2", pool_promote=True) as reader:
        assert writer.put(keys, blocks_for(keys, BB)).stored == 60
        assert writer.flush(10.0)
        assert writer.stats()["offloads"]["pool"]["written"] == 60
        pools = live_pools(m)
        assert set(pools.values()) == {a.tcp, b.tcp}
        # The directory, fed by the pools' own events: every key in one pool, both pools used (most_available).
        assert until(lambda: all(w >= 0 for w in m.locate(keys, {"role": "pool"}).where))
        found = m.locate(keys, {"role": "pool"})
        assert {h[0] for h in found.holders} == set(pools)
        assert all(h[2] == pools[h[0]] for h in found.holders)  # addresses come with the answer
        # Another engine gets them from where the directory says, bytes exact, and promotes them.
        assert reader.contains(keys) == [True] * 60  # answered from the directory
        out = torch.empty(60, BB, dtype=torch.uint8)
        assert_all_hits_exact(reader.get(keys, out), out, blocks_for(keys, BB))
        assert reader.stats()["offloads"]["pool"]["promoted"] == 60
    # Heartbeats carry the bandwidth the pools measure serving gets (what the master's cost model prices).
    big = make_keys(160, start=10_000)  # 2.5 MiB: gets of a MiB and more are measured
    conn = connect(a.tcp, BB, timeout_s=2.0)
    src = blocks_for(big, BB)
    rows = np.uint64(src.data_ptr()) + np.arange(160, dtype=np.uint64) * np.uint64(BB)
    assert all(conn.put(big, rows)) and all(conn.get(big, rows))
    conn.close()
    assert until(lambda: any(t["bw"] > 0 for n in m.nodes() if n["address"] == a.tcp for t in n["tiers"]))


def test_a_pool_that_shuts_down_is_dropped_at_once(cluster, make_keys):
    mp, m, a, b = cluster
    keys = make_keys(40, start=500)
    with store_for(mp.endpoint, "engine-1") as writer:
        writer.put(keys, blocks_for(keys, BB))
        assert writer.flush(10.0)
    assert until(lambda: all(w >= 0 for w in m.locate(keys, {"role": "pool"}).where))
    node_a = next(n for n, addr in live_pools(m).items() if addr == a.tcp)
    on_a = [m.locate([k], {"role": "pool"}).holders[0][0] == node_a for k in keys]
    assert 0 < sum(on_a) < 40
    t0 = time.monotonic()
    assert a.terminate() == 0  # SIGTERM: goodbye to the master
    assert "said goodbye" in a.log()
    states = {n["node"]: n["state"] for n in m.nodes()}
    assert states[node_a] == "dead" and time.monotonic() - t0 < 5.0  # well before its 5 s lease
    where = m.locate(keys, {"role": "pool"}).where
    assert [w < 0 for w in where] == on_a
    with store_for(mp.endpoint, "engine-3") as reader:
        out = torch.empty(40, BB, dtype=torch.uint8)
        assert reader.get(keys, out) == [not x for x in on_a]


def test_route_put_and_locate_filter_by_labels(cluster):
    mp, m, a, b = cluster
    m.call(api.register("engine-y", "inc", 0, [("dram", 1 << 40)]))
    m.call(api.inventory("engine-y", "inc", 0, 0, True, {}, {}))
    targets = m.route_put([4096] * 10, labels={"role": "nobody"})
    assert targets == [None] * 10
    assert {t[0] for t in m.route_put([4096] * 10)} == {"engine-y"}  # without labels the engine's huge DRAM wins
