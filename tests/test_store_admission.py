"""Admission at every level: a block a full DRAM's session-aware policy declines (it would evict an agent predicted
back sooner) is not lost when a tier is under DRAM: it goes down as DRAM's eviction would (the lower tier's offload
policy, then that tier's own policy decide), by put (copied) and by put_in_place (filled into scratch rows) alike.
Real tiers: the SSD on a real file, the pool a real kvtier-pool subprocess. LRU (learning nothing, admitting
everything) is the negative control: it takes the late agent's blocks into DRAM by evicting the early one's."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from conftest import block_for, blocks_for
from kvtier.policies import Arrival, Completion
from kvtier.pool.process import PoolDaemon
from kvtier.tools.replay.replayer import VirtualClock  # a settable clock the store's policy reads
from kvtier.store import TieredStore

BB = 4096
DRAM = 12  # blocks


def chain(agent: int, n: int) -> list[bytes]:
    return [(agent * 100_000 + d).to_bytes(16, "little") for d in range(n)]


class Agents:
    """Drives a store as an engine would: each request's arrival, its new blocks put tail first, its completion."""

    def __init__(self, store: TieredStore, clock: VirtualClock, in_place: bool) -> None:
        self.store, self.clock, self.in_place, self.n = store, clock, in_place, 0

    def arrive(self, agent: int, keys: list[bytes]) -> str:
        self.n += 1
        self.store.observe(arrivals=[Arrival(f"r{self.n}", keys, self.clock.now, f"a{agent}")])
        return f"r{self.n}"

    def put(self, keys: list[bytes]) -> Any:
        keys = keys[::-1]  # tail first, as the replay and the connectors' saves
        if not self.in_place:
            return self.store.put(keys, blocks_for(keys, BB))

        def fill(index: list[int], slots: Any) -> None:
            for i, address in zip(index, slots.ptrs.tolist()):
                src = block_for(keys[i], BB)
                ctypes.memmove(address, src.data_ptr(), BB)

        return self.store.put_in_place(keys, fill)

    def turn(self, agent: int, keys: list[bytes], stop: str) -> Any:
        rid = self.arrive(agent, keys)
        result = self.put(keys)
        self.clock.now += 1.0
        self.store.observe(completions=[Completion(rid, self.clock.now, stop)])
        return result


def declined_scenario(store: TieredStore, clock: VirtualClock, in_place: bool) -> tuple[Any, list[bytes], list[bytes]]:
    """Teach the store's policies that tool_use is back in ~5 s and end_turn in ~600 s; then L (2 blocks) waits
    for its human and S (10 blocks) runs a tool: DRAM (12 blocks) is full. L comes back with 6 blocks more: a
    session-aware DRAM declines them (S is back sooner). Returns (the put's result, S's keys, L's new keys)."""
    agents = Agents(store, clock, in_place)
    for _ in range(8):
        agents.turn(1, chain(1, 1), "tool_use")
        clock.now += 5.0
    for _ in range(3):
        agents.turn(2, chain(2, 1), "end_turn")
        clock.now += 600.0
    store.remove(chain(1, 1) + chain(2, 1))
    late, soon = chain(10, 8), chain(20, 10)
    agents.turn(10, late[:2], "end_turn")
    agents.turn(20, soon, "tool_use")
    agents.arrive(10, late)  # L is back, in flight: predicted back only after its next answer
    return agents.put(late[2:]), soon, late[2:]


def held(tier: Any, keys: list[bytes]) -> list[bool]:
    return [bool(h) for h in tier.contains(keys)]


def assert_bytes(store: TieredStore, keys: list[bytes]) -> None:
    out = torch.empty(len(keys), BB, dtype=torch.uint8)
    assert store.get(keys, out) == [True] * len(keys)
    assert torch.equal(out, blocks_for(keys, BB)), "a block read back is not its key's bytes"


@contextmanager
def ssd_store(tmp_path, policy: str) -> Iterator[tuple[TieredStore, VirtualClock]]:
    clock = VirtualClock()
    config = {"dram_capacity": DRAM * BB, "ssd_path": str(tmp_path / "ssd"), "ssd_capacity": 64 * BB,
              "ssd_direct_io": "false", "ssd_fsync": False, "ssd_staging_bytes": 0, "eviction": policy,
              "dram_admission": "every"}
    with TieredStore.from_config(config, BB, clock=clock) as store:
        yield store, clock


@contextmanager
def pool_store(policy: str) -> Iterator[tuple[TieredStore, VirtualClock]]:
    clock = VirtualClock()
    with PoolDaemon(64 * BB, BB, eviction=policy, policy_clock="sender") as pool:
        config = {"mode": "distributed", "pool": pool.endpoint("tcp"), "dram_capacity": DRAM * BB,
                  "pool_offload": "on_evict", "pool_staging_bytes": 0, "pool_timeout_ms": 10_000,
                  "pool_connections": 1, "eviction": policy, "dram_admission": "every"}
        with TieredStore.from_config(config, BB, clock=clock) as store:
            yield store, clock


@pytest.mark.parametrize("in_place", [False, True], ids=["put", "put_in_place"])
def test_a_block_dram_declines_is_admitted_by_the_ssd_under_it(tmp_path, in_place):
    with ssd_store(tmp_path, "default") as (store, clock):
        result, soon, declined = declined_scenario(store, clock, in_place)
        dram, ssd = store.tiers
        assert len(result.rejected) == len(declined), "DRAM's policy took blocks of the agent back last"
        assert held(dram, soon) == [True] * len(soon), "DRAM evicted the agent back soonest"
        assert held(dram, declined) == [False] * len(declined)
        assert held(ssd, declined) == [True] * len(declined), "a block DRAM declined was lost"
        assert_bytes(store, declined)
        assert store.stats()["offload"]["written"] >= len(declined)


@pytest.mark.parametrize("in_place", [False, True], ids=["put", "put_in_place"])
def test_lru_takes_every_block_into_dram(tmp_path, in_place):
    """The negative control: the same traffic under LRU evicts the early agent from DRAM for the late one's."""
    with ssd_store(tmp_path, "lru") as (store, clock):
        result, soon, declined = declined_scenario(store, clock, in_place)
        assert not result.rejected
        assert held(store.tiers[0], declined) == [True] * len(declined)
        assert not all(held(store.tiers[0], soon))


@pytest.mark.slow  # a pool process: ~3 s
@pytest.mark.parametrize("in_place", [False, True], ids=["put", "put_in_place"])
def test_a_block_dram_declines_is_admitted_by_the_pool_under_it(in_place):
    with pool_store("default") as (store, clock):
        result, soon, declined = declined_scenario(store, clock, in_place)
        dram, pool = store.tiers
        assert len(result.rejected) == len(declined)
        assert held(dram, soon) == [True] * len(soon)
        assert held(pool, declined) == [True] * len(declined), "a block DRAM declined was lost"
        assert_bytes(store, declined)


def test_the_replays_store_follows_the_same_rule(tmp_path):
    """kvtier replay measures the store it builds (sweep.build_store: the real TieredStore from a Config): what
    DRAM declines reaches its SSD there too, so the replay's rows are what a live store does."""
    from kvtier.tools.replay.sweep import build_store

    clock = VirtualClock()
    with build_store("default", {"dram_capacity": DRAM, "ssd_capacity": 64}, {"ssd_path": str(tmp_path), "dram_admission": "every"},
                     sim_block_bytes=BB, clock=clock) as store:
        result, soon, declined = declined_scenario(store, clock, in_place=False)
        assert len(result.rejected) == len(declined)
        assert held(store.tiers[0], soon) == [True] * len(soon)
        assert held(store.tiers[1], declined) == [True] * len(declined)
        assert_bytes(store, declined)


def test_admission_above_a_lower_tier_follows_dram_admission(tmp_path):
    """dram_admission "auto" (the default): DRAM declines where no tier is below it and above an SSD alone (the
    tests above), not above a pool; "last": only where no tier is below it; "every": above any tier."""
    ssd = {"ssd_path": str(tmp_path / "auto"), "ssd_capacity": 64 * BB, "ssd_direct_io": "false"}
    stores = [TieredStore.from_config({"dram_capacity": DRAM * BB}, BB),
              TieredStore.from_config({"dram_capacity": DRAM * BB, **ssd}, BB),
              TieredStore.from_config({"dram_capacity": DRAM * BB, "dram_admission": "last", **ssd,
                                       "ssd_path": str(tmp_path / "last")}, BB)]
    try:
        assert [s.tiers[0]._table._admission for s in stores] == ["enforce", "enforce", "advice"]
    finally:
        for s in stores:
            s.close()
