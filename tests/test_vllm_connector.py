"""KVTierConnector against the real vLLM 0.33 classes (installed by tests/run.sh from tests/requirements-vllm.txt).

The engine in vllm_engine.py is vLLM's own Scheduler, KV cache planner and allocator with the worker-side
connectors driven as the model runner drives them; only the forward is fake, and it writes KV that is a
pure function of (rank, layer, position, token), so every load is checked bit-exactly after every step.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.connectors.vllm import KVTierConnector  # noqa: E402
from kvtier.connectors.vllm.metadata import KVTierMetadata, LoadPlan  # noqa: E402
from kvtier.connectors.vllm.transfer import session_lease  # noqa: E402
from vllm_engine import (  # noqa: E402
    BLOCK,
    PREFIX,
    Engine,
    RequestStatus,
    expected_kv,
    keys_of,
    make_request,
    save_a_then_drop_hbm,
    vllm_config,
    worker_side,
)


def hold_saves(side, monkeypatch) -> threading.Event:
    """Saves stop at their gather (the engine's blocks are still being read) until the returned gate is set."""
    gate = threading.Event()
    gather = type(side.kv).gather

    def slow_gather(self, ids, packed):
        assert gate.wait(10)
        gather(self, ids, packed)

    monkeypatch.setattr(type(side.kv), "gather", slow_gather)
    return gate


def run_until_finished(eng: Engine, req, max_steps: int = 100) -> None:
    """Step until ``req`` finished (unlike Engine.run, not until its saves are done and vLLM freed it)."""
    eng.add(req)
    for _ in range(max_steps):
        eng.step()
        if req.is_finished():
            return
    raise AssertionError(f"request {req.request_id} not finished after {max_steps} steps")


# ---- creation -------------------------------------------------------------------------------------------


def test_factory_creates_both_roles_from_module_path(model, ipc_dir):
    config = vllm_config(model, {"dram_capacity": "4MiB", "ipc_dir": ipc_dir})
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is KVTierConnector
    eng = Engine(config)
    try:
        for conn, role in ((eng.connector, KVConnectorRole.SCHEDULER), (eng.workers[0], KVConnectorRole.WORKER)):
            assert isinstance(conn, KVTierConnector) and isinstance(conn, KVConnectorBase_V1)
            assert conn.role == role
            assert conn.requires_kv_delivery is False
        assert KVTierConnector.requires_piecewise_for_cudagraph({"load_mode": "layerwise"})
        assert not KVTierConnector.requires_piecewise_for_cudagraph({})
        with pytest.raises(RuntimeError, match="worker-side method was called on the scheduler"):
            eng.connector.get_block_ids_with_load_errors()
        with pytest.raises(RuntimeError, match="scheduler-side method was called on the worker"):
            eng.workers[0].build_connector_meta(None)
    finally:
        eng.close()


def test_bad_extra_config_names_the_key(model, ipc_dir):
    config = vllm_config(model, {"dram_capacty": "4MiB", "ipc_dir": ipc_dir})
    with pytest.raises(ValueError, match="dram_capacty.*did you mean dram_capacity"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, _sched_config(config))
    config = vllm_config(model, {"load_mode": "eager", "ipc_dir": ipc_dir})
    with pytest.raises(ValueError, match="load_mode: 'eager' is not one of async, layerwise"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, _sched_config(config))


def _sched_config(config):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])


# ---- the main flow ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_layout", ["LBNHC", "BLNHC"])
def test_prefix_saved_by_a_is_loaded_by_b_bit_exact(engine, kv_layout):
    eng = engine(kv_layout=kv_layout)
    save_a_then_drop_hbm(eng)
    store = worker_side(eng).store
    assert store.stats()["put_stored"] == 5  # A's five full blocks; its partial last block is not stored
    b = make_request("B", PREFIX + [9, 9, 9, 9])
    eng.add(b)
    statuses = []
    for _ in range(100):
        eng.step()  # verifies every computed token of every running request after each step
        statuses.append(b.status)
        if b.num_computed_tokens >= len(PREFIX):
            break
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses  # asynchronous: the forward never waited
    assert b.num_computed_tokens >= len(PREFIX)
    eng.run([b])
    assert eng.load_errors == set()
    stats = store.stats()
    assert stats["get_hits"] == 5 and stats["get_misses"] == 0
    assert stats["put_stored"] == 5  # B saved nothing again: its blocks came from the store
    assert eng.verified_tokens > 0


def test_blocks_from_dram_and_ssd_in_one_load(engine, tmp_path):
    eng = engine(ssd_path=str(tmp_path / "ssd"), ssd_capacity="64MiB", ssd_segment_bytes="1MiB",
                 ssd_offload="write_through", ssd_staging_bytes=0)
    save_a_then_drop_hbm(eng)
    store = worker_side(eng).store
    b = make_request("B", PREFIX + [9, 9, 9, 9])
    keys = keys_of(eng, b)
    assert store.tiers[1].contains(keys[:5]) == [True] * 5
    store.tiers[0].remove([keys[1], keys[3]])  # DRAM dropped two; the SSD still has them
    sources = []  # what vLLM's prefix-cache stats learn about where the hit came from
    real = eng.connector.get_external_cache_hit_sources
    eng.connector.get_external_cache_hit_sources = lambda r, n: sources.append(real(r, n)) or sources[-1]
    eng.add(b)
    eng.run([b])  # bit-exact after every step: three blocks straight from DRAM slots, two through staging
    assert eng.load_errors == set()
    assert sources == [{CacheHitSource.HOST: 3 * BLOCK, CacheHitSource.DISK: 2 * BLOCK}]
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["hits"] == 2
    assert store.tiers[0].contains(keys[:5]) == [True] * 5  # the SSD hits were promoted back to DRAM


def test_kv_role_producer_only_saves_consumer_only_loads(engine):
    producer = engine(kv_role="kv_producer")
    save_a_then_drop_hbm(producer)
    b = make_request("B", PREFIX + [9])
    producer.add(b)
    producer.run([b])
    assert worker_side(producer).store.stats()["put_stored"] == 5
    assert worker_side(producer)._server.served == 0  # a producer never looks up
    consumer = engine(kv_role="kv_consumer")
    save_a_then_drop_hbm(consumer)
    assert worker_side(consumer).store.stats()["put_stored"] == 0  # a consumer never stores


def test_layerwise_mode_loads_in_the_forward(engine):
    eng = engine(load_mode="layerwise")
    save_a_then_drop_hbm(eng)
    b = make_request("B", PREFIX + [9, 9, 9, 9])
    eng.add(b)
    sync_steps = 0
    for _ in range(100):
        so = eng.step()
        sync_steps += so.has_sync_kv_loads
        assert b.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        if b.is_finished():
            break
    assert sync_steps == 1 and b.is_finished() and eng.load_errors == set()
    assert worker_side(eng).store.stats()["get_hits"] == 5


def test_wait_for_layer_load_waits_only_for_its_layer(engine, monkeypatch):
    eng = engine(load_mode="layerwise")
    a = make_request("A", PREFIX + [5, 6, 7])
    eng.add(a)
    eng.run([a])
    worker = eng.workers[0]
    side = worker_side(eng)
    gate = threading.Event()
    scatter = type(side.kv).scatter_layer

    def gated(self, layer, ids, packed):
        if layer > 0:
            assert gate.wait(10)
        scatter(self, layer, ids, packed)

    monkeypatch.setattr(type(side.kv), "scatter_layer", gated)
    free = eng.scheduler.kv_cache_manager.block_pool.get_new_blocks(5)
    targets = tuple(blk.block_id for blk in free)
    kv = eng.kv[0]
    names = eng.layer_names
    for name in names:
        kv[name][list(targets)] = 0
    meta = KVTierMetadata(loads=[LoadPlan("B", 999, tuple(a.block_hashes[:5]), targets, layerwise=True)])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    t0 = time.monotonic()
    worker.wait_for_layer_load(names[0])  # returns although layer 1 and 2 are held back
    assert time.monotonic() - t0 < 5
    def layer_ok(layer: int) -> bool:
        return all(bool((kv[names[layer]][targets[p // BLOCK], :, p % BLOCK, :]
                         == expected_kv(0, layer, p, PREFIX[p])).all()) for p in range(0, 5 * BLOCK, 7))

    assert layer_ok(0) and not layer_ok(2)
    gate.set()
    worker.wait_for_layer_load(names[2])
    assert layer_ok(1) and layer_ok(2)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()


def test_preempted_and_resumed_requests_stay_bit_exact(engine):
    """More decode than HBM holds: vLLM preempts, frees blocks (after handle_preemptions), resumes with new
    block tables and reloads or recomputes; every step's KV is verified, and the prefix is loaded."""
    eng = engine(num_blocks=40)
    save_a_then_drop_hbm(eng)
    reqs = [make_request(f"R{i}", PREFIX + [i] * 3, max_tokens=90) for i in range(4)]
    preempted = set()
    for r in reqs:
        eng.add(r)
    for _ in range(600):
        so = eng.step()
        preempted |= set(so.preempted_req_ids or ())
        if all(r.is_finished() for r in reqs) and not eng.scheduler.requests:
            break
    assert all(r.is_finished() for r in reqs)
    assert preempted, "the test needs vLLM to preempt"
    assert eng.load_errors == set()
    assert worker_side(eng).store.stats()["get_hits"] >= 4 * 5


# ---- failures ---------------------------------------------------------------------------------------------


def test_block_gone_between_lookup_and_load_is_reported_and_recomputed(engine):
    eng = engine()
    save_a_then_drop_hbm(eng)
    side = worker_side(eng)
    b = make_request("B", PREFIX + [9, 9, 9, 9])
    eng.add(b)
    eng.step()  # sends the lookup
    deadline = time.monotonic() + 10
    while side._server.served == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    keys = keys_of(eng, b)
    assert all(side.store.pins.count(k) == 1 for k in keys[:5])  # pinned from lookup to load
    assert side.store.remove([keys[2]]) == 1  # a pin stops eviction, not an explicit remove
    eng.run([b])
    block_ids_seen = eng.load_errors
    assert len(block_ids_seen) == 1  # B's third block: reported, recomputed, and verified after every step
    assert side.store.contains(keys[:5]) == [True] * 5  # recomputed block 2 was stored again
    assert len(side.store.pins) == 0  # the lookup's lease ended with the load


def test_finished_request_keeps_its_blocks_until_its_saves_are_done(engine, monkeypatch):
    eng = engine()
    side = worker_side(eng)
    gate = hold_saves(side, monkeypatch)
    a = make_request("A", PREFIX + [5, 6, 7])
    run_until_finished(eng, a)
    free_before = eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    for _ in range(3):
        eng.step()
        assert "A" in eng.scheduler.requests  # delay_free: vLLM has not freed A's blocks
    gate.set()
    eng.wait_idle_transfers()
    assert "A" not in eng.scheduler.requests
    assert eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    assert side.store.stats()["put_stored"] == 5


def test_unanswered_lookup_is_a_miss(engine, caplog):
    eng = engine(lookup_timeout_s=0.2)
    worker_side(eng)._server.close()  # the worker's lookup service is gone
    a = make_request("A", PREFIX + [5, 6, 7])
    eng.add(a)
    t0 = time.monotonic()
    eng.run([a])  # scheduled without a load once the lookup timed out
    assert time.monotonic() - t0 < 10
    assert "lookup for request A unanswered after 0.2 s" in caplog.text
    assert a.num_computed_tokens > len(PREFIX)  # computed, not loaded


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
            with rec.naming(keys[i : i + 1], hashes[i : i + 1]):
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


def _stalled_waits(caplog, req_id: str, what: str) -> int:
    return sum(1 for r in caplog.records if r.levelname == "ERROR" and f"request {req_id}: still waiting" in
               r.getMessage() and what in r.getMessage())


def test_preemption_wait_for_a_stuck_save_logs_and_counts(engine, monkeypatch, caplog):
    """handle_preemptions must wait for the save's gather (vLLM reuses the blocks next), but never silently."""
    eng = engine(load_timeout_s=0.1)
    side = worker_side(eng)
    gate = hold_saves(side, monkeypatch)
    run_until_finished(eng, make_request("A", PREFIX + [5, 6, 7]))
    side.take_counters()
    threading.Timer(0.45, gate.set).start()
    t0 = time.monotonic()
    side.handle_preemptions(KVTierMetadata(preempted={"A"}))
    assert time.monotonic() - t0 >= 0.4  # it did wait for the gather
    assert _stalled_waits(caplog, "A", "save of 5 blocks") >= 2
    assert side.take_counters()["stalled_waits"] >= 2
    eng.wait_idle_transfers()


def test_cancelled_layerwise_load_wait_logs_and_counts(engine, monkeypatch, caplog):
    eng = engine(load_mode="layerwise", load_timeout_s=0.1)
    save_a_then_drop_hbm(eng)
    worker, side = eng.workers[0], worker_side(eng)
    gate = threading.Event()
    scatter = type(side.kv).scatter_layer
    monkeypatch.setattr(type(side.kv), "scatter_layer",
                        lambda self, layer, ids, packed: (gate.wait(10), scatter(self, layer, ids, packed)))
    targets = tuple(blk.block_id for blk in eng.scheduler.kv_cache_manager.block_pool.get_new_blocks(5))
    a_hashes = tuple(make_request("x", PREFIX).block_hashes[:5])
    worker.bind_connector_metadata(KVTierMetadata(loads=[LoadPlan("B", 999, a_hashes, targets, layerwise=True)]))
    worker.start_load_kv(None)
    threading.Timer(0.45, gate.set).start()
    assert worker.get_block_ids_with_load_errors() == set(targets)  # timed out: cancelled, recomputed
    assert _stalled_waits(caplog, "B", "cancelled layer-wise load of 5 blocks") >= 2
    assert side.take_counters()["stalled_waits"] >= 2
    worker.clear_connector_metadata()


def test_a_router_computes_the_keys_the_connector_stored(engine, model):
    """vllm_namespace + VllmBlockHasher from token ids alone give, for every rank, the keys in its store."""
    from kvtier.hashers import VllmBlockHasher, vllm_namespace

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
