"""KVTierConnector against the real vLLM 0.33 classes (installed by tests/run.sh from tests/requirements-vllm.txt).

The engine in vllm_engine.py is vLLM's own Scheduler, KV cache planner and allocator with the worker-side
connectors driven as the model runner drives them; only the forward is fake, and it writes KV that is a
pure function of (rank, layer, position, token), so every load is checked bit-exactly after every step.
This file: creation, the save/load flow and its failures; ranks, hints, KV events and stats are in
test_vllm_connector_events.py.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.connectors.vllm import KVTierConnector  # noqa: E402
from kvtier.connectors.vllm.metadata import KVTierMetadata, LoadPlan  # noqa: E402
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
                 ssd_offload="write_through", ssd_staging_bytes=0, ssd_promote=True)
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
    assert list(store.tiers[0].contains(keys[:5])) == [True] * 5  # the SSD hits were promoted back to DRAM


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


# ---- stalled waits -----------------------------------------------------------------------------------------


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
