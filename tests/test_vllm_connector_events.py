"""KVTierConnector against the real vLLM 0.33 classes: what it tells the engine and the cluster about blocks.

TP ranks kept apart, session hints and the master's session pins as store leases, the KV events vLLM
publishes (once for all ranks, DRAM and SSD media), worker stats, and the keys a router computes from token
ids alone. The engine harness is vllm_engine.py (vLLM's own scheduler and allocator, a fake forward); the
save/load flow itself is in test_vllm_connector.py.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvtier.connectors.vllm import KVTierConnector  # noqa: E402
from kvtier.connectors.vllm.transfer import session_lease  # noqa: E402
from vllm_engine import (  # noqa: E402
    BLOCK,
    PREFIX,
    keys_of,
    make_request,
    save_a_then_drop_hbm,
    worker_side,
)


# ---- ranks, hints, events ----------------------------------------------------------------------------------


def test_two_tp_ranks_never_see_each_others_blocks(engine):
    eng = engine(tp=2)
    save_a_then_drop_hbm(eng)
    b = make_request("B", PREFIX + [9, 9, 9, 9])
    r0, r1 = worker_side(eng, 0), worker_side(eng, 1)
    k0, k1 = keys_of(eng, b, 0), keys_of(eng, b, 1)
    assert not set(k0) & set(k1)
    assert r0.store.contains(k0[:5]) == [True] * 5 and r1.store.contains(k1[:5]) == [True] * 5
    assert r0.store.contains(k1[:5]) == [False] * 5 and r1.store.contains(k0[:5]) == [False] * 5
    # Rank 1 loses block 3: the prefix every rank holds is three blocks long.
    r1.store.remove([k1[3]])
    eng.add(b)
    eng.run([b])  # each rank's KV (different per rank) verified bit-exact after every step
    assert eng.load_errors == set()
    assert r0.store.stats()["get_hits"] == 3 and r1.store.stats()["get_hits"] == 3


def test_session_hints_lease_the_blocks_in_the_store(engine):
    eng = engine()
    save_a_then_drop_hbm(eng, kvtier={"ttl_s": 600, "session": "agent-7", "priority": 2})
    side = worker_side(eng)
    a_keys = side.namespace.keys(make_request("x", PREFIX).block_hashes)
    assert side.store.leases.keys_of(session_lease("agent-7")) == set(a_keys)
    assert all(side.store.pins.count(k) == 1 for k in a_keys)
    assert side.store.leases.release(session_lease("agent-7")) == 5
    assert len(side.store.pins) == 0


def test_a_master_session_pin_keeps_the_sessions_blocks_past_the_requests_own_hint(engine, tmp_path):
    """End to end: a router tells kvtier-master "agent-7 comes back within a minute" before the turn; the
    turn's own hint (kv_transfer_params) asks for 0.3 s only; the worker's store, reporting to the master
    through a NodeAgent, keeps the session's blocks for the minute, and lets them go when the router unpins."""
    from kvtier.client import MasterClient, NodeAgent
    from masterproc import MasterProcess

    eng = engine()
    side = worker_side(eng)
    with MasterProcess(tmp_path) as master, MasterClient(master.endpoint) as m:
        agent = NodeAgent.for_store(side.store, master.endpoint, "w0", heartbeat_s=0.05).start()
        try:
            m.pin(session="agent-7", ttl_s=60)
            deadline = time.monotonic() + 10
            while agent.hints is None or "agent-7" not in agent.hints.session_pins:
                assert time.monotonic() < deadline, "the session pin never reached the node"
                time.sleep(0.02)
            save_a_then_drop_hbm(eng, kvtier={"ttl_s": 0.3, "session": "agent-7"})
            a_keys = side.namespace.keys(make_request("x", PREFIX).block_hashes)
            time.sleep(0.4)  # the request's own 0.3 s are over
            assert side.store.leases.sweep() == 0 and side.store.leases.expires_in(session_lease("agent-7")) > 50
            assert all(side.store.pins.count(k) == 1 for k in a_keys)
            m.unpin(session="agent-7")
            while side.store.pins.count(a_keys[0]):
                assert time.monotonic() < deadline + 10, "the unpin never released the session's blocks"
                time.sleep(0.02)
            assert session_lease("agent-7") not in side.store.leases and len(side.store.pins) == 0
        finally:
            agent.close()


def test_kv_events_report_stored_and_removed_blocks_once_for_all_ranks(engine):
    eng = engine(tp=2, events=True)
    a = make_request("A", PREFIX + [5, 6, 7])
    eng.add(a)
    eng.run([a])
    eng.wait_idle_transfers()
    ours = [e for e in eng.events if e.medium == "CPU"]
    expect = [maybe_convert_block_hash(h) for h in a.block_hashes[:5]]
    assert len(ours) == 1 and isinstance(ours[0], BlockStored) and ours[0].block_hashes == expect
    for rank in (0, 1):
        worker_side(eng, rank).store.remove(keys_of(eng, a, rank)[:2])
    eng.step()
    removed = [e for e in eng.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert len(removed) == 1 and removed[0].block_hashes == expect[:2]


def test_scheduler_keys_a_block_by_the_hash_that_ends_it():
    from types import SimpleNamespace

    from kvtier.connectors.vllm.scheduler import SchedulerSide
    from kvtier.connectors.vllm.settings import ConnectorSettings

    req = SimpleNamespace(block_hashes=[bytes([i]) for i in range(12)])
    side = SchedulerSide(ConnectorSettings(), lookups=None, block_size=64, hash_block_size=16)  # type: ignore
    assert side.num_hashed_blocks(req) == 3
    assert side.block_hashes(req, 0, 3) == [bytes([3]), bytes([7]), bytes([11])]
    assert side.block_hashes(req, 1, 2) == [bytes([7])]
    one = SchedulerSide(ConnectorSettings(), lookups=None, block_size=16)  # type: ignore
    assert one.block_hashes(req, 2, 5) == req.block_hashes[2:5]


def test_worker_stats_count_what_moved(engine):
    eng = engine()
    save_a_then_drop_hbm(eng)
    b = make_request("B", PREFIX + [9])
    eng.add(b)
    eng.run([b])
    block_bytes = worker_side(eng).store.block_bytes
    got = eng.stats.reduce()
    assert got["save_blocks"] == 5 and got["save_bytes"] == 5 * block_bytes
    assert got["load_blocks"] == 5 and got["load_bytes"] == 5 * block_bytes
    assert got["lookups_served"] >= 2 and "load_GBps" in got and "save_GBps" in got
    assert type(KVTierConnector.build_kv_connector_stats(eng.stats.data)) is type(eng.stats)


def test_ssd_events_survive_dram_evicting_before_the_write_lands(tmp_path):
    """on_evict with write-behind: DRAM reports "removed" before the SSD's "stored" arrives; the recorder must
    still know the block's engine hash then (the store holds it, staged for the disk)."""
    import torch

    from kvtier.connectors.vllm.events import EventRecorder
    from kvtier.keys import Namespace
    from kvtier.store import TieredStore

    bb = 64 << 10
    store = TieredStore.from_config({"dram_capacity": 4 * bb, "ssd_path": str(tmp_path), "ssd_capacity": 64 * bb,
                                     "ssd_segment_bytes": 16 * bb, "ssd_staging_bytes": 8 * bb}, bb)
    rec = EventRecorder(16, holds=store.contains)
    store.add_listener(rec.on_store_event)
    hashes = [bytes([i]) * 32 for i in range(8)]
    keys = Namespace("m").keys(hashes)
    with store:
        for i in range(8):
            with rec.naming(keys[i : i + 1], [(hashes[i], 0)]):
                store.put(keys[i : i + 1], torch.zeros(1, bb, dtype=torch.uint8))
        assert store.flush(10)
        events = rec.take()
        on_ssd = [h for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE" for h in e.block_hashes]
        assert on_ssd == [maybe_convert_block_hash(h) for h in hashes[:4]]  # the four DRAM evicted
        assert store.tiers[1].contains(keys[:4]) == [True] * 4
        store.remove(keys[:1])  # gone everywhere: reported from the SSD too, then forgotten
        removed = [(e.medium, e.block_hashes) for e in rec.take() if isinstance(e, BlockRemoved)]
        assert removed == [("STORAGE", [maybe_convert_block_hash(hashes[0])])]
        assert keys[0] not in rec._known and keys[0] not in rec._in_transit


def test_event_quorum_counts_blocks_not_whole_events():
    from kvtier.connectors.vllm.events import EventQuorum

    def stored(*hs, medium="STORAGE"):
        return BlockStored(block_hashes=list(hs), parent_block_hash=None, token_ids=[], block_size=16,
                           lora_id=None, medium=medium, lora_name=None, group_idx=0)

    q = EventQuorum(ranks=2)
    q.add([stored(1, 2), stored(1, medium="CPU")])  # rank 0 wrote 1 and 2 in one batch; CPU is another medium
    assert q.take() == []
    q.add([stored(1)])  # rank 1 writes them one by one
    assert q.take() == [stored(1)]
    q.add([stored(2), stored(2)])  # a repeated report adds nothing new
    assert q.take() == [stored(2)]
    q.add([BlockRemoved(block_hashes=[1, 2], medium="STORAGE", group_idx=0)])
    assert q.take() == [BlockRemoved(block_hashes=[1, 2], medium="STORAGE", group_idx=0)]
    q.add([BlockRemoved(block_hashes=[2], medium="STORAGE", group_idx=0), stored(1)])  # rank 1; rank 1 re-stores
    assert q.take() == []  # the removal of 2 was published already; one rank's store of 1 is not a quorum
    q.add([BlockRemoved(block_hashes=[1], medium="STORAGE", group_idx=0)])  # 1 stored-again then lost
    assert q.take() == [BlockRemoved(block_hashes=[1], medium="STORAGE", group_idx=0)]


def test_kv_events_report_ssd_blocks_with_default_offload(engine, tmp_path):
    """Default settings (on_evict, write-behind): blocks DRAM evicts to the SSD are published as STORAGE."""
    # Two ranks, each on its own subdirectory of ssd_path: a block is published once both ranks stored it.
    eng = engine(tp=2, events=True, dram_capacity="48KiB", ssd_path=str(tmp_path / "ssd"),
                 ssd_capacity="16MiB", ssd_segment_bytes="1MiB", ssd_staging_bytes="1MiB")
    a = make_request("A", PREFIX + [5, 6, 7])
    eng.add(a)
    eng.run([a])
    eng.wait_idle_transfers()
    c = make_request("C", [900 + i for i in range(5 * BLOCK)] + [1])  # five other blocks: DRAM evicts A's
    eng.add(c)
    eng.run([c])
    eng.wait_idle_transfers()
    assert all(worker_side(eng, rank).store.flush(10) for rank in (0, 1))
    eng.step()  # carries the SSD's stored events to the scheduler
    storage = [h for e in eng.events if isinstance(e, BlockStored) and e.medium == "STORAGE" for h in e.block_hashes]
    expect = [maybe_convert_block_hash(h) for h in a.block_hashes[:5]]
    held = [all(on) for on in zip(*(worker_side(eng, r).store.tiers[1].contains(keys_of(eng, a, r)) for r in (0, 1)))]
    assert sum(held) > 0, "the test's DRAM is too large: nothing was evicted to the SSD"
    assert sorted(storage) == sorted(h for h, on in zip(expect, held[:5]) if on)  # each once


def test_a_router_computes_the_keys_the_connector_stored(engine, model):
    """vllm_namespace + VllmBlockHasher from token ids alone give, for every rank, the keys in its store."""
    from kvtier.keys.hashers import VllmBlockHasher, vllm_namespace

    eng = engine(tp=2)
    save_a_then_drop_hbm(eng)
    hashes = VllmBlockHasher(BLOCK).hashes(PREFIX)
    for rank in (0, 1):
        side = worker_side(eng, rank)
        # revision: none given; weights: the fingerprint the worker logs (from the model directory's files)
        assert side.identity.weights
        ns = vllm_namespace(model, side.kv.layout.fingerprint, rank=rank, world_size=2,
                            weights=side.identity.weights)
        assert ns == side.namespace
        assert side.store.contains(ns.keys(hashes)) == [True] * 5
