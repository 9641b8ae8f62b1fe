"""KVTierConnector saves against the real vLLM 0.33 classes: one copy, engine KV straight into DRAM slots.

A save gathers a request's new blocks into slots the store reserved (``TieredStore.put_in_place``), not into
staging rows that ``put`` copies again; the node pool on top of a standalone store has no slots to write,
so it keeps the staged path. Every load is verified bit-exact by the engine harness after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from kvtier.blocks import BlockRows  # noqa: E402
from poolproc import PoolProcess  # noqa: E402
from vllm_engine import (  # noqa: E402
    PREFIX,
    keys_of,
    make_request,
    save_a_then_drop_hbm,
    worker_side,
)


def record_gathers(side, monkeypatch, fail_first: bool = False) -> list:
    """The destination of every save gather (optionally failing the first one, as a dying copy would)."""
    destinations: list = []
    gather = type(side.kv).gather

    def recording(self, ids, packed):
        destinations.append(packed)
        if fail_first and len(destinations) == 1:
            raise RuntimeError("gather failed")
        gather(self, ids, packed)

    monkeypatch.setattr(type(side.kv), "gather", recording)
    return destinations


def load_b(eng):
    b = make_request("B", PREFIX + [9, 9, 9, 9])
    eng.add(b)
    eng.run([b])  # the harness checks every computed token's KV bit-exactly
    assert eng.load_errors == set()
    return b


def test_a_save_gathers_straight_into_dram_slots_and_loads_back_bit_exact(engine, monkeypatch):
    eng = engine()
    side = worker_side(eng)
    dram = side.store.tiers[0]
    destinations = record_gathers(side, monkeypatch)
    save_a_then_drop_hbm(eng)
    assert destinations and all(isinstance(d, BlockRows) for d in destinations)  # no staging tensor
    ptrs = np.concatenate([d.ptrs for d in destinations]).astype(np.int64)
    start = dram.buffer.ptr
    assert len(ptrs) == 5 and ((ptrs >= start) & (ptrs + side.store.block_bytes <= start + dram.capacity_bytes)).all()
    b = load_b(eng)
    assert side.store.stats()["get_hits"] == 5
    assert list(dram.contains(keys_of(eng, b)[:5])) == [True] * 5
    got = eng.stats.reduce()
    assert got["save_in_place_blocks"] == got["save_blocks"] == 5 and "save_staged_blocks" not in got


def test_a_failed_gather_publishes_nothing_leaks_no_slot_and_the_blocks_are_saved_again(engine, monkeypatch):
    eng = engine()
    side = worker_side(eng)
    record_gathers(side, monkeypatch, fail_first=True)
    save_a_then_drop_hbm(eng)  # A's save fails: logged, A still finishes
    stats = side.store.stats()
    dram = stats["tiers"]["dram"]
    assert stats["put_stored"] == 0 and dram["used_bytes"] == 0 and dram["extra"]["pending"] == 0
    assert stats["inflight_puts"] == 0
    load_b(eng)  # nothing to load: B computes the prefix and saves it
    assert side.store.stats()["put_stored"] == 5
    assert eng.stats.reduce()["save_in_place_blocks"] == 5


@pytest.fixture
def node_pool(tmp_path):
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity="8MiB") as pool:
        yield pool


def test_standalone_without_private_dram_keeps_staged_saves(engine, node_pool, monkeypatch):
    eng = engine(mode="standalone", pool=node_pool.ipc, pool_timeout_ms=2000)
    side = worker_side(eng)
    assert not side.store.writes_in_place  # the node pool is the top tier
    destinations = record_gathers(side, monkeypatch)
    save_a_then_drop_hbm(eng)
    assert destinations and not any(isinstance(d, BlockRows) for d in destinations)
    load_b(eng)
    got = eng.stats.reduce()
    assert got["save_staged_blocks"] == got["save_blocks"] == 5 and "save_in_place_blocks" not in got
