"""Prefetch through the master (master/prefetch.py, kvtier/client/store_prefetch.py): a router or an operator asks
that the node which will serve a prompt bring its prefix up into DRAM. A real kvtier-master subprocess; the node is
a real store (DRAM over a real SSD tier) with its Prefetcher, PrefetchDriver and NodeAgent. The prefix pushed
down to the node's SSD is in DRAM, with its own bytes, after the SDK call, and stays on the SSD without it
(negative control); unknown keys, a prefix bigger than DRAM, a flood, a dead node and a master that is down are
each answered, bounded, by the call's deadline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import blocks_for
from kvtier import TieredStore
from kvtier.client import AsyncMasterClient, MasterClient, MasterError, MasterTimeout, NodeAgent, Router, api
from kvtier.keys import Namespace
from kvtier.master.prefetch import MAX_ORDERS_PER_NODE
from kvtier.policies import Arrival, Completion
from kvtier.prefetch import PrefetchDriver, Prefetcher
from masterproc import MasterProcess
from poolproc import PoolProcess, until
from promkit import scrape
from redisproc import RedisProcess, needs_redis

BB = 4096
NS = Namespace("prefetch-sdk")
A = NS.keys(range(8))  # the agent's prefix, pushed down to the SSD
B = NS.keys(range(100, 116))  # what pushed it down
BIG = NS.keys(range(200, 240))  # 40 blocks: more than the node's 16-block DRAM
UNKNOWN = NS.keys(range(900, 904))


class Node:
    """A store (16-block DRAM, LRU, over an SSD tier) with its Prefetcher moved by a driver, reporting to the
    master as ``name``. The LRU grants a prefetch free DRAM slots only (kvtier/policies/base.py), so the tests
    free some first."""

    def __init__(self, tmp, master: str, name: str = "n1", prefetch: bool = True) -> None:
        self.store = TieredStore.from_config(
            {"dram_capacity": 16 * BB, "ssd_path": str(tmp / f"ssd-{name}"), "ssd_capacity": 256 * BB,
             "ssd_direct_io": "false", "ssd_fsync": False, "ssd_staging_bytes": 0, "eviction": "lru"}, BB)
        self.prefetcher = Prefetcher(self.store) if prefetch else None
        self.driver = PrefetchDriver(self.prefetcher, tick_s=0.01) if self.prefetcher is not None else None
        self.agent = NodeAgent.for_store(self.store, master, name, heartbeat_s=0.1, timeout_s=1.0,
                                         prefetcher=self.prefetcher).start()

    def put(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), 2):  # a put never evicts its own batch: small puts, so older ones go down
            self.store.put(keys[i : i + 2], blocks_for(keys[i : i + 2], BB))

    def where(self, keys: list[bytes]) -> list[str]:
        found = self.store.lookup_prefix(keys)
        return [t for t, n in found.runs for _ in range(n)] + ["none"] * (len(keys) - found.length)

    def read_back(self, keys: list[bytes]) -> None:
        out = blocks_for(keys, BB).clone().zero_()
        assert self.store.get(keys, out) == [True] * len(keys)
        assert (out == blocks_for(keys, BB)).all(), "a prefetched block came back with other bytes"

    def push_down(self, keys: list[bytes]) -> None:
        """``keys`` to the SSD, then DRAM room for them (the pushers removed): what a prefetch may fill."""
        self.put(keys)
        self.put(B)
        self.store.remove(B[: len(keys)])
        self.store.flush()
        assert self.where(keys) == ["ssd"] * len(keys)
        assert self.agent.wait_synced()

    def close(self) -> None:
        self.agent.close()
        if self.driver is not None:
            self.driver.close()
        self.store.close()


@pytest.fixture
def cluster(tmp_path):
    with MasterProcess(tmp_path, lease_s=1.0) as mp:
        node = Node(tmp_path, mp.endpoint)
        try:
            yield mp, node
        finally:
            node.close()


def metric(mp: MasterProcess, outcome: str) -> float:
    for line in scrape(mp.metrics_port).splitlines():
        if line.startswith(f'kvtier_master_prefetches_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no kvtier_master_prefetches_total{{outcome={outcome!r}}}")


def test_the_sdk_call_brings_a_prefix_up_from_the_nodes_ssd(cluster):
    mp, node = cluster
    node.push_down(A)
    with MasterClient(mp.endpoint) as m:
        assert m.lookup(A, touch=False).for_node("n1") == {"ssd": 8}
        time.sleep(0.5)  # negative control: heartbeats and driver ticks, no call: the prefix stays on the SSD
        assert node.where(A) == ["ssd"] * 8
        got = m.prefetch("n1", A, session="agent-1")
        assert (got.outcome, got.held, got.in_top, got.queued, got.session) == ("accepted", 8, 0, 8, "agent-1")
        assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
        node.read_back(A)
        assert node.prefetcher.counts.from_tier == {"ssd": 8}
        assert node.agent.store_prefetch.counts["started"] == 1
        # The master learns where the blocks are now, and says so when asked again.
        assert until(lambda: m.lookup(A, touch=False).for_node("n1").get("dram") == 8, timeout=10)
        again = m.prefetch("n1", A)
        assert again.outcome == "ignored" and "already" in again.why
    assert metric(mp, "accepted") == 1 and metric(mp, "delivered") == 1 and metric(mp, "ignored") == 1


def test_a_session_named_alone_brings_up_the_prefix_the_node_saw_last(cluster):
    mp, node = cluster
    node.store.observe(arrivals=[Arrival("r1", A, node.store.clock(), "agent-7")])  # the node served agent-7's turn
    node.push_down(A)
    with MasterClient(mp.endpoint) as m:
        got = m.prefetch("n1", session="agent-7")
        assert got.outcome == "accepted" and got.queued == 0 and "remembers" in got.why
        assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
        stranger = m.prefetch("n1", session="nobody")
        assert stranger.outcome == "accepted"  # only the node knows its sessions: it answers in its counts
        assert until(lambda: node.agent.store_prefetch.counts["unknown_session"] == 1, timeout=10)
    assert node.agent.store_prefetch.counts["started"] == 1


def test_the_router_prefetches_the_prefix_its_plan_loads_on_the_worker_it_picks(cluster):
    mp, node = cluster
    node.push_down(A)
    with MasterClient(mp.endpoint) as m:
        router = Router(m, NS, block_tokens=16, prefill_tokens_per_s=1.0)  # recompute costs ages: load wins
        routed = router.route(A, ["n1", "n2"], session="agent-3")
        assert routed.best.worker == "n1" and routed.best.load_tokens == 8 * 16
        assert routed.prefetch is not None and routed.prefetch.outcome == "accepted"
        assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
        off = router.route(A, ["n1"], prefetch=False)
        assert off.prefetch is None

    async def ask_async():
        async with AsyncMasterClient(mp.endpoint) as am:
            return await Router(am, NS, block_tokens=16).prefetch_async(A, "ghost", session="agent-3")

    assert asyncio.run(ask_async()).outcome == "rejected"  # the asyncio client's call, answered alike


def kvtier_prefetch(mp: MasterProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "prefetch", "--master", mp.endpoint, *args],
                          capture_output=True, text=True, timeout=60)


def test_the_operators_command_line(cluster):
    mp, node = cluster
    node.push_down(A)
    refused = kvtier_prefetch(mp, "--node", "n1", "--keys", ",".join(k.hex() for k in UNKNOWN))
    assert refused.returncode == 1 and refused.stdout.startswith("rejected: ") and "unknown keys" in refused.stdout
    ok = kvtier_prefetch(mp, "--node", "n1", "--keys", ",".join(k.hex() for k in A), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["outcome"] == "accepted" and json.loads(ok.stdout)["queued"] == 8
    assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
    assert kvtier_prefetch(mp, "--node", "n1").returncode == 2  # neither keys nor a session


def test_a_prefix_held_by_a_remote_pool_comes_up_through_the_nodes_pool_tier(tmp_path):
    """A real kvtier-pool holds the prefix (another engine wrote it); the serving node's store (the default,
    session-aware policy) reaches the pool through its pool tier (the master's directory), and the order brings the
    prefix into its DRAM."""
    with MasterProcess(tmp_path, lease_s=5.0) as mp:
        opts = {"capacity": "16MiB", "block_bytes": BB, "master": mp.endpoint, "args": ("--heartbeat-s", "0.2")}
        with PoolProcess(tmp_path, name="pa", **opts), MasterClient(mp.endpoint) as m:
            config = {"mode": "distributed", "master": mp.endpoint, "dram_capacity": 64 * BB, "pool_timeout_ms": 500}
            with TieredStore.from_config({**config, "node_id": "writer"}, BB) as writer:
                writer.put(A, blocks_for(A, BB))
                assert writer.flush(10.0)
            assert until(lambda: all(w >= 0 for w in m.locate(A, {"role": "pool"}, touch=False).where), timeout=10)
            store = TieredStore.from_config({**config, "node_id": "engine-2"}, BB)
            prefetcher = Prefetcher(store)
            driver = PrefetchDriver(prefetcher, tick_s=0.01)
            agent = NodeAgent.for_store(store, mp.endpoint, "engine-2", heartbeat_s=0.1, prefetcher=prefetcher).start()
            node = Node.__new__(Node)  # its helpers, over this store
            node.store = store
            try:
                assert agent.wait_synced()
                assert node.where(A) == ["pool"] * 8
                # The session-aware default policy grants room to agents it knows: this node served agent-1 before
                # (a sticky router sends it back here).
                store.observe(arrivals=[Arrival("r1", A[:4], store.clock(), "agent-1")],
                              completions=[Completion("r1", store.clock(), "tool_use")])
                got = m.prefetch("engine-2", A, session="agent-1")
                assert (got.outcome, got.held, got.in_top) == ("accepted", 8, 0)
                assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
                node.read_back(A)
                assert prefetcher.counts.from_tier == {"pool": 8}
            finally:
                agent.close(), driver.close(), store.close()


@needs_redis
def test_with_a_shared_directory_the_order_reaches_the_node_through_whichever_master_it_heartbeats(tmp_path):
    """The router asks master 1; the node heartbeats master 0: the order is a recorded write, in both views."""
    with RedisProcess(tmp_path) as redis:
        ms = []
        try:
            for i in range(2):
                (tmp_path / f"m{i}").mkdir()
                ms.append(MasterProcess(tmp_path / f"m{i}", lease_s=5.0, args=("--directory", redis.url)).start())
            node = Node(tmp_path, ms[0].endpoint)
            try:
                node.push_down(A)
                with MasterClient(ms[1].endpoint) as m:
                    assert until(lambda: m.lookup(A, touch=False).for_node("n1") == {"ssd": 8}, timeout=10)
                    assert m.prefetch("n1", A, session="agent-1").outcome == "accepted"
                assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
                node.read_back(A)
            finally:
                node.close()
            assert until(lambda: metric(ms[0], "delivered") == 1 == metric(ms[1], "delivered"), timeout=10)
        finally:
            for mp in ms:
                mp.kill()


def test_unknown_keys_a_partly_known_prefix_and_one_bigger_than_dram_are_answered(cluster):
    mp, node = cluster
    node.push_down(A)
    node.put(BIG)  # 40 blocks through a 16-block DRAM: the head goes down to the SSD
    node.store.flush()
    assert node.agent.wait_synced()
    with MasterClient(mp.endpoint) as m:
        unknown = m.prefetch("n1", UNKNOWN)
        assert unknown.outcome == "rejected" and "unknown keys" in unknown.why and unknown.queued == 0
        partly = m.prefetch("n1", A + UNKNOWN, session="p")
        assert partly.outcome == "clipped" and partly.held == 8 and partly.queued == 8
        assert "first 8 of 12" in partly.why
        big = m.prefetch("n1", BIG, session="big")
        assert big.outcome == "clipped" and big.held == 40 and big.queued == 16 and "more than" in big.why
        nobody = m.prefetch("ghost", A)
        assert nobody.outcome == "rejected" and "not registered" in nobody.why
        with pytest.raises(MasterError) as e:
            m.call(api.Call("prefetch", {"node": "n1"}, dict))
        assert e.value.code == "bad_request"
        with pytest.raises(MasterError):
            m.call(api.Call("prefetch", {"node": "n1", "keys": b"x" * 15}, dict))
        node.store.remove(BIG[-16:])  # DRAM room (the LRU grants free slots only): the orders asked first fill it
        assert until(lambda: node.where(A) == ["dram"] * 8, timeout=10), node.where(A)
        node.read_back(A)
        assert node.agent.store_prefetch.counts["started"] == 2
    assert metric(mp, "rejected") == 2 and metric(mp, "clipped") == 2


def _silent_node(m: MasterClient, name: str, keys: list[bytes]) -> str:
    """A node registered by hand holding ``keys`` in its SSD, which then says nothing (as after kill -9)."""
    inc = name + "-inc"
    m.call(api.register(name, inc, 0, [("dram", 16 * BB), ("ssd", 1024 * BB)]))
    m.call(api.inventory(name, inc, 0, 0, True, {"ssd": keys}, {"ssd": BB}))
    return inc


def test_a_flood_of_prefetches_is_bounded_per_node(tmp_path):
    with MasterProcess(tmp_path, lease_s=30.0) as mp, MasterClient(mp.endpoint) as m:
        inc = _silent_node(m, "slow", A)
        answers = [m.prefetch("slow", A, session=f"s{i}") for i in range(3 * MAX_ORDERS_PER_NODE)]
        outcomes = [a.outcome for a in answers]
        assert outcomes[:MAX_ORDERS_PER_NODE] == ["accepted"] * MAX_ORDERS_PER_NODE
        assert set(outcomes[MAX_ORDERS_PER_NODE:]) == {"rejected"}
        assert "waiting" in answers[-1].why
        assert m.prefetch("slow", A, session="s0").outcome == "accepted"  # the same session: replaced, not added
        reply = m.call(api.heartbeat("slow", inc, 0, {}, {}, {}, 0.0))
        assert len(reply.prefetch) == MAX_ORDERS_PER_NODE and reply.prefetch[0].keys == A
        assert {o.session for o in reply.prefetch} == {f"s{i}" for i in range(MAX_ORDERS_PER_NODE)}
        assert m.call(api.heartbeat("slow", inc, 0, {}, {}, {}, 0.0)).prefetch == []  # taken once
        assert m.prefetch("slow", A, session="after").outcome == "accepted"  # room again
        assert metric(mp, "rejected") == 2 * MAX_ORDERS_PER_NODE
        assert metric(mp, "delivered") == MAX_ORDERS_PER_NODE


def test_a_dead_node_is_answered_by_the_deadline_and_its_orders_expire(tmp_path):
    with MasterProcess(tmp_path, lease_s=1.0) as mp, MasterClient(mp.endpoint, timeout_s=2.0) as m:
        _silent_node(m, "gone", A)
        queued = m.prefetch("gone", A, ttl_s=0.3)  # within its lease the master cannot tell it is gone
        assert queued.outcome == "accepted" and queued.expires > 0
        assert until(lambda: metric(mp, "expired") == 1, timeout=10)
        assert until(lambda: [n["state"] for n in m.nodes() if n["node"] == "gone"] == ["dead"], timeout=10)
        t0 = time.monotonic()
        dead = m.prefetch("gone", A)
        assert time.monotonic() - t0 < 2.0
        assert dead.outcome == "rejected" and "dead" in dead.why
    assert "prefetch expired" in mp.log() and "prefetch refused" in mp.log()


def test_a_master_that_is_down_ends_the_call_by_its_deadline(tmp_path):
    mp = MasterProcess(tmp_path).start()
    mp.kill()
    with MasterClient(mp.endpoint, timeout_s=0.3) as m:
        t0 = time.monotonic()
        with pytest.raises(MasterTimeout):
            m.prefetch("n1", A)
        assert time.monotonic() - t0 < 1.5


def test_a_node_without_a_prefetcher_counts_its_orders_ignored(tmp_path):
    with MasterProcess(tmp_path, lease_s=1.0) as mp:
        node = Node(tmp_path, mp.endpoint, "plain", prefetch=False)
        try:
            node.push_down(A)
            with MasterClient(mp.endpoint) as m:
                assert m.prefetch("plain", A).outcome == "accepted"
                assert until(lambda: node.agent.store_prefetch.counts["ignored"] == 1, timeout=10)
            assert node.where(A) == ["ssd"] * 8
        finally:
            node.close()


def test_keys_as_an_array_and_as_bytes_are_the_same_request():
    arr = np.frombuffer(b"".join(A), "<u8").reshape(-1, 2)
    assert api.prefetch("n", arr).body["keys"] == api.prefetch("n", A).body["keys"] == b"".join(A)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["add", "add", "take", "prune", "wait"]), st.sampled_from("abc"),
                                st.integers(0, 5), st.integers(0, 30), st.floats(0.1, 3.0)), max_size=80))
# the key bound makes the last add prune node c's two orders (c is not registered), its own session's among them:
# that order ends once, expired, not also replaced (the test counted it twice)
@example(steps=[("add", "c", 0, 5, 1.0), ("add", "c", 1, 5, 1.0), ("add", "a", 2, 30, 1.0), ("add", "c", 0, 6, 1.0)])
def test_orders_stay_within_their_bounds_and_each_ends_once(steps):
    """PrefetchOrders in-process (bounds shrunk to 4 orders per node, 40 keys in all): whatever the sequence of
    orders, heartbeats, prunes and time passing, the count of keys waiting is exact and within the bound, and every
    order accepted is delivered once, expires, or is replaced by its session's next, never lost or doubled."""
    from unittest import mock

    import kvtier.master.prefetch as prefetch_mod
    from kvtier.master import ops_node
    from kvtier.master.service import MasterSettings, MasterState

    now = [1e6]
    state = MasterState(MasterSettings(lease_s=1e9), wall=lambda: now[0])
    for n in "ab":  # c is never registered: prune drops its orders
        ops_node.register(state, {"node": n, "incarnation": n, "seq": 0, "tiers": [["dram", 1 << 30]]})
    orders = state.prefetches
    accepted = ended = 0
    with mock.patch.object(prefetch_mod, "MAX_ORDERS_PER_NODE", 4), \
            mock.patch.object(prefetch_mod, "MAX_QUEUED_KEYS", 40):
        for kind, node, session, nkeys, dt in steps:
            if kind == "add":
                old = orders._by_node.get(node, {}).get(f"s{session}")  # noqa: SLF001 - the order it may replace
                order = prefetch_mod._Order(f"s{session}", b"k" * 16 * nkeys, now[0] + dt, "test")
                if orders.add(state, node, order) is None:
                    accepted += 1
                    # replaced, unless the add's own prune expired it first (counted ``expired`` then: a node
                    # the registry lacks has its orders' deadlines moved to now)
                    ended += old is not None and old.expires > now[0]
            elif kind == "take":
                work = orders.work_for(state, node).get("prefetch", [])
                assert all(expires > now[0] for _, _, expires in work)
                ended += len(work)
            elif kind == "prune":
                orders.prune(state)
            else:
                now[0] += dt
            queues = orders.export()
            assert orders.queued_keys == sum(len(o[1]) // 16 for q in queues.values() for o in q) <= 40
            assert all(len(q) <= 4 for q in queues.values())
        expired = state.metrics.prefetches.labels("expired")._value.get()
        assert accepted == ended + expired + len(orders)
