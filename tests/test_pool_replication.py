"""Hot-block replication end to end, real processes: a kvtier-master with --replicate-heat, real kvtier-pools,
stores in distributed mode. A hot prefix held by one pool gets a copy on another, pool to pool; kill -9 of the
pool that held the first copy and the prefix is still served, bit-exact, while a cold prefix that lived only
there is a miss (the control); once the prefix cools the replica is dropped; an operator can ask a pool for a
copy with the pool op itself (a keyless pool: from its own user's process on its ipc socket)."""

from __future__ import annotations

import time

import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.client import MasterClient
from kvtier.store import TieredStore
from kvtier.transport.channel import Channel
from kvtier.transport.dial import shared_context
from kvtier.wire import pool as P
from masterproc import MasterProcess
from poolproc import PoolProcess, wait_for

BB = 16 << 10


def holders(m: MasterClient, keys) -> dict[str, int]:
    """Per pool, how many of ``keys`` the master's directory says it holds."""
    out: dict[str, int] = {}
    for k in keys:
        for h in m.lookup([k], touch=False).hits:
            out[h.node] = out.get(h.node, 0) + h.blocks
    return out


def store_for(master: str, node: str) -> TieredStore:
    return TieredStore.from_config({"mode": "distributed", "master": master, "node_id": node,
                                    "dram_capacity": 8 * BB, "pool_timeout_ms": 500}, BB)


@pytest.fixture
def cluster(tmp_path):
    args = ("--replicate-heat", "3", "--replicate-interval-s", "0.3", "--heat-half-life-s", "1")
    with MasterProcess(tmp_path, lease_s=1.5, args=args) as mp:
        opts = {"capacity": "8MiB", "block_bytes": BB, "master": mp.endpoint, "args": ("--heartbeat-s", "0.1")}
        with PoolProcess(tmp_path, name="pa", **opts) as a, PoolProcess(tmp_path, name="pb", **opts) as b:
            with MasterClient(mp.endpoint) as m:
                wait_for(lambda: sum(n["state"] == "live" for n in m.nodes()) == 2, what="two live pools")
                yield mp, m, a, b


def test_a_hot_prefix_survives_the_death_of_the_pool_holding_its_first_copy(cluster, make_keys):
    mp, m, a, b = cluster
    hot, cold = make_keys(12), make_keys(12, start=500)
    with store_for(mp.endpoint, "writer") as w:
        w.put(hot + cold, blocks_for(hot + cold, BB))
        assert w.flush(10.0)
    wait_for(lambda: m.lookup(hot + cold, touch=False).any == 24, what="the blocks in the directory")
    # Every block lives in one pool: where route_put put it.
    first = {k: m.locate([k], touch=False).holder(0)[0] for k in hot + cold}
    # Engines read the hot prefix again and again (each read is a locate: an access).
    for _ in range(6):
        m.locate(hot)
    both = wait_for(lambda: all(v >= 12 for v in holders(m, hot).values()) and len(holders(m, hot)) == 2 and
                 holders(m, hot), what="a second copy of every hot block")
    assert both == {n: 12 for n in both}
    assert all(sum(1 for _ in holders(m, [k])) == 1 for k in cold)  # the cold prefix was not copied
    # kill -9 of the pool holding most of the hot prefix's first copies (after its lease the master drops it).
    victim_name = max(set(first[k] for k in hot), key=lambda n: sum(first[k] == n for k in hot))
    victim = next(p for p in (a, b) if p.info["node"] == victim_name)
    victim.kill()
    wait_for(lambda: [n["state"] for n in m.nodes() if n["node"] == victim_name] == ["dead"], 10.0, "its death")
    with store_for(mp.endpoint, "reader") as r:
        out = torch.zeros(12, BB, dtype=torch.uint8)
        assert_all_hits_exact(r.get(hot, out), out, blocks_for(hot, BB))  # every hot block, from the replica
        lost = [k for k in cold if first[k] == victim_name]
        assert lost, "the control needs cold blocks that lived only on the dead pool"
        got = r.get(lost, torch.zeros(len(lost), BB, dtype=torch.uint8))
        assert got == [False] * len(lost)  # no replica: a miss (recomputed), never wrong bytes


@pytest.mark.slow  # waits for heat to decay
def test_a_replica_is_dropped_when_its_prefix_cools(cluster, make_keys):
    mp, m, a, b = cluster
    keys = make_keys(6, start=2000)
    with store_for(mp.endpoint, "writer") as w:
        w.put(keys, blocks_for(keys, BB))
        assert w.flush(10.0)
    wait_for(lambda: m.lookup(keys, touch=False).any == 6)
    for _ in range(6):
        m.locate(keys)
    wait_for(lambda: len(holders(m, keys)) == 2, what="replicas")
    # Heat halves every second: a few seconds later it is below half the threshold, and one copy goes.
    wait_for(lambda: sum(holders(m, keys).values()) == 6, 20.0, "the replicas dropped")


def test_an_operator_asks_a_pool_to_copy_blocks_from_another(tmp_path, make_keys):
    keys = make_keys(8, start=3000)
    with PoolProcess(tmp_path, name="src", capacity="4MiB", block_bytes=BB) as src, \
            PoolProcess(tmp_path, name="dst", ipc=True, capacity="4MiB", block_bytes=BB) as dst:
        from kvtier.transport import connect

        c = connect(src.tcp, BB, timeout_s=2.0)
        data = blocks_for(keys, BB)
        rows = torch.arange(8, dtype=torch.int64) * BB + data.data_ptr()
        assert all(c.put(keys, rows.numpy().astype("uint64")))
        c.close()
        # A keyless pool takes copy_from from a process of its own user on its ipc socket only
        # (test_copy_from_hostile.py: a tcp caller is refused).
        ch = Channel(dst.ipc, shared_context(), timeout_s=5.0)
        from kvtier import wire

        answer = ch.call(P.COPY_FROM, {"source": src.tcp, "keys": wire.pack_keys(keys + make_keys(2, start=9000))})
        ch.close()
        assert answer.body["copied"] == 8 and answer.body["missing"] == 2
        d = connect(dst.tcp, BB, timeout_s=2.0)
        out = torch.zeros(8, BB, dtype=torch.uint8)
        orows = torch.arange(8, dtype=torch.int64) * BB + out.data_ptr()
        assert_all_hits_exact(d.get(keys, orows.numpy().astype("uint64")), out, data)
        d.close()


def test_a_copy_from_a_dead_source_ends_by_its_deadline_and_the_pool_serves_on(tmp_path, make_keys):
    """The source pool is gone (a port nobody listens on): the op answers `unavailable` within the copier's
    deadline, nothing is stored, and the pool answers the next request (the negative of the copy above)."""
    import socket

    from kvtier import wire
    from kvtier.pool.replicas import TIMEOUT_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    keys = make_keys(4, start=7000)
    with PoolProcess(tmp_path, name="dst", ipc=True, capacity="4MiB", block_bytes=BB) as dst:
        ch = Channel(dst.ipc, shared_context(), timeout_s=TIMEOUT_S + 5.0)
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            ch.call(P.COPY_FROM, {"source": dead, "keys": wire.pack_keys(keys)})
        assert time.monotonic() - t0 < TIMEOUT_S + 3.0
        assert "copy_from " + dead in str(err.value), err.value
        assert ch.call(P.CONTAINS, {"keys": wire.pack_keys(keys)}).body["held"] == P.bitmap([False] * 4)
        ch.close()
