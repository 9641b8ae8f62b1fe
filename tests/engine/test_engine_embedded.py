"""A real vLLM engine generating through kvtier's embedded store (DRAM, then an SSD that outlives the process).

The tests run in order and share the module's engines and SSD directory:
1. DRAM: request A computes a 1,000-token prefix; after ``reset_prefix_cache()`` request B (same prefix) loads
   all 31 blocks from kvtier (cached tokens and vLLM's external-prefix-cache metrics say so) and its greedy
   tokens and logprobs equal an engine's without the connector.
2. SSD: a new engine process with the same config serves B's prefix from disk (write_through), outputs equal.
3. A block of prefix C corrupted on disk between the two processes: a miss from that block on, never data;
   C's outputs equal an engine's that had C's blocks before the bad one cached and prefilled the rest (vLLM
   recomputes from the failed block; on some CPUs that chunked prefill differs from a one-shot one in the
   logprobs' last bits, so the one-shot reference is the wrong comparison: Reference.resumed).
4. Negative control: new weights written over the model (same path) under the same operator-stated checkpoint
   id (the module's engines set ``weights_fingerprint: checkpoint-1`` instead of the automatic fingerprint, so
   the namespace does not change with the weights): the next engine loads the old
   weights' KV and its outputs differ from an engine computing under the new weights: the comparisons above
   can fail, and loaded KV really feeds attention. (With the fingerprint on, the default, that KV is never
   looked at: test_engine_durability.py.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from .enginekit import BLOCK, MAX_TOKENS, Engines, Reference, assert_same, build_model, connector, prompt_tokens

pytestmark = pytest.mark.slow

P1, P2 = prompt_tokens(1), prompt_tokens(2)
A, B, C = P1 + [5, 6, 7], P1 + [8, 9], P2 + [4]
FULL = (len(P1) // BLOCK) * BLOCK  # 992 tokens: 31 full blocks


class State:
    """What the ordered tests hand each other."""

    model: Path
    ssd: Path
    config: dict[str, Any]
    corrupted_block: int = -1


@pytest.fixture(scope="module")
def st(engine_py, work) -> State:
    s = State()
    root = work / "embedded"
    s.model = build_model(engine_py, root / "llama", seed=0)  # this module's copy: test 4 rewrites its weights
    s.ssd = root / "ssd"
    s.config = connector({"dram_capacity": "64MiB", "ssd_path": str(s.ssd), "ssd_capacity": "64MiB",
                          "ssd_offload": "write_through", "ipc_dir": str(root),
                          # A stated checkpoint id instead of the automatic weights fingerprint: test 4 rewrites the
                          # weights under it (the automatic one is tested in test_engine_durability.py).
                          "weights_fingerprint": "checkpoint-1"})
    return s


def metric_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def test_dram_hit_equals_engine_without_connector(st: State, engines: Engines, reference: Reference):
    e1 = engines.start("embedded-e1", st.model, st.config)
    info = e1.wait_ready()
    assert info["kv_connector"] == "KVTierConnector" and info["vllm"].startswith("0.32")
    # vLLM's CPU platform forces the async scheduler off (on a GPU 0.33 turns it on by default): these tests
    # run the connector under the synchronous scheduler only. Should a CPU build turn it on, this says so.
    assert info["async_scheduling"] is False
    a = e1.generate([A])[0]
    assert a["cached"] == 0
    assert_same(a, reference(A))  # the cold path through the connector (saves only) changes nothing
    assert e1.generate([C])[0]["cached"] == 0
    assert e1.reset_prefix_cache()
    before = e1.metrics()
    b = e1.generate([B])[0]
    after = e1.metrics()
    assert b["cached"] == FULL
    assert metric_delta(before, after, "vllm:external_prefix_cache_hits") == FULL
    assert metric_delta(before, after, "vllm:prefix_cache_hits") == 0  # not from vLLM's own cache
    assert metric_delta(before, after, "vllm:prompt_tokens_cached_by_source{source=host}") == FULL
    assert_same(b, reference(B))
    (store,) = e1.store_stats()
    assert store["tiers"]["dram"]["hits"] >= FULL // BLOCK
    assert store["tiers"]["ssd"]["blocks"] >= 2 * (FULL // BLOCK)  # write_through: A's and C's prefixes on disk
    assert e1.close() == 0


def _corrupt_one_block_of_c(ssd: Path) -> int:
    """Flip a byte in C's 11th block on disk (C's blocks are the second 31 the first engine wrote, in save
    order: the index's ``seq``). Returns the block's position in C's prefix."""
    from kvtier.tiers.ssd.index import DiskIndex

    (rank_dir,) = [p.parent for p in ssd.glob("*/*/index")]
    index = DiskIndex(rank_dir / "index", sync=False, map_size=64 << 20)
    try:
        entries = sorted((e for _, e in index.items() if e is not None), key=lambda e: e.seq)
    finally:
        index.close()
    per_prefix = FULL // BLOCK
    assert len(entries) >= 2 * per_prefix, f"{len(entries)} blocks on disk"
    victim = entries[per_prefix + 10]
    fd = os.open(rank_dir / f"seg-{victim.segment:05d}.dat", os.O_RDWR)
    try:
        at = victim.offset + victim.length // 2
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    return 10


def test_new_process_serves_prefix_from_ssd(st: State, engines: Engines, reference: Reference):
    st.corrupted_block = _corrupt_one_block_of_c(st.ssd)  # used by the next test; B's blocks are untouched
    e2 = engines.start("embedded-e2", st.model, st.config)
    before = e2.metrics()
    b = e2.generate([B])[0]
    after = e2.metrics()
    assert b["cached"] == FULL
    assert metric_delta(before, after, "vllm:prompt_tokens_cached_by_source{source=disk}") == FULL
    assert_same(b, reference(B))


def test_corrupted_ssd_block_is_a_miss_never_wrong_tokens(st: State, engines: Engines, reference: Reference):
    (e2,) = [e for e in engines.started if e.log_path.name == "embedded-e2.log"]
    c = e2.generate([C])[0]
    # recomputed from the bad block on, never loaded from it: the same as an engine that had C's blocks before
    # the bad one cached and prefilled the rest
    assert_same(c, reference.resumed(C, st.corrupted_block))
    (store,) = e2.store_stats()
    ssd = store["tiers"]["ssd"]
    # The lookup found all 31 blocks (the index lists them); the read of the bad one failed its checksum and
    # vLLM was told that block failed to load: it recomputed from there (kv_load_failure_policy: recompute).
    assert ssd["extra"]["checksum_failures"] == 1
    assert e2.close() == 0


def test_negative_control_kv_of_other_weights_gives_other_outputs(st: State, engines: Engines, engine_py, work):
    build_model(engine_py, st.model, seed=1)  # new weights in place: same path
    stale = engines.start("embedded-e4-w2", st.model, st.config)  # the same stated checkpoint id: same namespace
    fresh = engines.start("embedded-ref-w2", build_model(engine_py, work / "embedded" / "llama-w2", seed=1))
    recomputed = fresh.generate([B])[0]
    loaded = stale.generate([B])[0]
    assert loaded["cached"] == FULL  # the old weights' KV was loaded ...
    assert (loaded["tokens"], loaded["logprobs"]) != (recomputed["tokens"], recomputed["logprobs"])  # ... and shows
    assert len(loaded["tokens"]) == len(recomputed["tokens"]) == MAX_TOKENS
