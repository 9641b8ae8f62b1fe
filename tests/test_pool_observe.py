"""The pool learns the agents: a real kvtier-pool subprocess receives the store's observations (the ``observe``
op, kvtier/wire/observations.py) and its session-aware policy evicts the agent predicted back last, where LRU
(the negative control) evicts the least recently used one. Bad observe messages are refused with a clear error,
counted, and the pool goes on serving."""

from __future__ import annotations


import pytest

from conftest import blocks_for
from kvtier.client import MasterClient
from kvtier.policies import Arrival, Completion
from kvtier.pool.process import PoolDaemon
from kvtier.tools.replay.replayer import VirtualClock  # a settable clock the store's policy reads
from kvtier.store import TieredStore
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from kvtier.wire import pool as P
from masterproc import MasterProcess
from poolproc import PoolProcess, until

BB = 4096


def chain(agent: int, n: int) -> list[bytes]:
    return [(agent * 100_000 + d).to_bytes(16, "little") for d in range(n)]


def pool_keeps(policy: str) -> tuple[list[bool], list[bool], int]:
    """Agents B (a tool call: back in ~5 s) then A (an answer to a human: back in ~600 s) fill a 14-block
    pool; agent C's 4 blocks then need room (the session-aware pool may decline some of them: admission). Returns (which of A's blocks the pool holds, which of B's, how many
    observations the pool took)."""
    clock = VirtualClock()
    with PoolDaemon(14 * BB, BB, eviction=policy, policy_clock="sender") as pool:
        config = {"mode": "distributed", "pool": pool.endpoint("tcp"), "dram_capacity": 2 * BB,
                  "pool_offload": "write_through", "pool_staging_bytes": 0, "pool_timeout_ms": 10_000,
                  "pool_connections": 1, "eviction": policy}
        with TieredStore.from_config(config, BB, clock=clock) as store:
            n = 0

            def turn(agent: int, keys: list[bytes], stop: str) -> None:
                nonlocal n
                n += 1
                store.observe(arrivals=[Arrival(f"r{n}", keys, clock.now, f"a{agent}")])
                store.put(keys[::-1], blocks_for(keys[::-1], BB))
                clock.now += 1.0
                store.observe(completions=[Completion(f"r{n}", clock.now, stop)])

            # The pool's policy learns: tool_use is back in 5 s (most gaps: an agent in flight is predicted back
            # about as soon), end_turn in 600 s.
            for _ in range(8):
                turn(1, chain(1, 1), "tool_use")
                clock.now += 5.0
            for _ in range(3):
                turn(2, chain(2, 1), "end_turn")
                clock.now += 600.0
            store.remove(chain(1, 1) + chain(2, 1))
            turn(20, chain(20, 7), "tool_use")  # B
            turn(10, chain(10, 7), "end_turn")  # A
            turn(30, chain(30, 4), "tool_use")  # C
            taken = connect(pool.endpoint("tcp"), BB, timeout_s=10.0)
            try:
                counters = taken.stats()["counters"]
            finally:
                taken.close()
            # held anywhere: DRAM (2 blocks) may keep one of them, the rest is the pool's
            return store.contains(chain(10, 7)), store.contains(chain(20, 7)), counters.get("observations", 0)


@pytest.mark.slow  # two pool processes: ~8 s
def test_the_pools_policy_learns_the_agents_from_the_stores_observations():
    a, b, observed = pool_keeps("default")
    assert observed > 0
    assert all(b), f"the pool evicted blocks of the agent back in 5 s: {b}"
    assert a == [True] * 3 + [False] * 4, f"the agent back last loses its deepest blocks: {a}"
    # LRU (told the same, learning nothing) evicts the least recently used agent: B, the one needed soonest.
    a_lru, b_lru, _ = pool_keeps("lru")
    assert not all(b_lru)


BAD = [
    ({"now": 1.0, "arrivals": [["r", b"x" * 15, 1.0, "s"]]}, "not a multiple of 16"),
    ({"now": 1.0, "arrivals": [["r"]]}, "list of 4 fields"),
    ({"now": 1.0, "arrivals": [["r", b"", float("nan"), "s"]]}, "finite number"),
    ({"now": 1.0, "hints": [[None, "s", 1.0, True, -1, None, None]]}, "subagents"),
    ({"now": 1.0, "arrivals": [["r", b"\0" * 16 * 70_000, 1.0, "s"]]}, "keys in one observe message"),
    ({"arrivals": []}, "now"),
]


def test_a_bad_observe_is_refused_clearly_and_the_pool_serves_on():
    with PoolDaemon(16 * BB, BB, eviction="default") as pool:
        conn = connect(pool.endpoint("tcp"), BB, timeout_s=10.0)
        try:
            for body, why in BAD:
                with pytest.raises(PoolError, match=why):
                    conn.channel.call(P.OBSERVE, body)
            ok = conn.channel.call(P.OBSERVE, {"now": 1.0, "scope": "t", "arrivals": [["r", b"\0" * 16, 1.0, "s"]]})
            assert ok.body["taken"] == 1  # the pool is sized (--block-bytes): its policy took the arrival
            assert conn.contains([b"\0" * 16]) == [False]
            assert conn.stats()["counters"]["observations"] == 1
        finally:
            conn.close()


@pytest.mark.slow  # a master and two pool processes: ~5 s
@pytest.mark.parametrize("staging", [0, 1 << 20], ids=["in-order", "write-behind"])
def test_every_remote_pool_the_master_knows_learns_before_this_store_used_it(tmp_path, staging):
    """Distributed: the pools registered with kvtier-master get the store's observations from its first arrival,
    before the store has put to or read from any of them (the route learned pools only from placements and
    lookups: the first arrivals reached none), in bounded batches (write-behind: at most MAX_OBSERVING in flight)."""
    bb = 16 << 10
    with MasterProcess(tmp_path, lease_s=5.0) as mp:
        opts = {"capacity": "8MiB", "block_bytes": bb, "master": mp.endpoint, "args": ("--heartbeat-s", "0.2")}
        with PoolProcess(tmp_path, name="pa", **opts) as a, PoolProcess(tmp_path, name="pb", **opts) as b:
            with MasterClient(mp.endpoint) as m:
                assert until(lambda: sum(n["labels"].get("role") == "pool" for n in m.nodes()) == 2)
            config = {"mode": "distributed", "master": mp.endpoint, "node_id": "engine-1", "dram_capacity": 16 * bb,
                      "pool_timeout_ms": 2000, "pool_staging_bytes": staging}
            with TieredStore.from_config(config, bb) as store:
                keys = chain(1, 3)
                store.observe(arrivals=[Arrival("r1", keys, None, "s1")])
                store.observe(completions=[Completion("r1", None, "tool_use")])

                def observed(pool: PoolProcess) -> int:
                    conn = connect(pool.tcp, bb, timeout_s=5.0)
                    try:
                        return conn.stats()["counters"].get("observations", 0)
                    finally:
                        conn.close()

                assert until(lambda: observed(a) == 2 and observed(b) == 2), (observed(a), observed(b))
                assert store.tiers[1].stats().extra["observations_dropped"] == 0
