"""A real vLLM engine's store across restarts, with the defaults a user gets.

1. A clean shutdown writes DRAM's blocks down to the SSD under the DEFAULT ``ssd_offload: on_evict`` (nothing
   was evicted, so nothing reached the disk before): a new engine process serves the prefix from disk.
2. New weights written at the same model path: the automatic weights fingerprint (``weights_fingerprint:
   auto``, the default) puts them in another namespace, so the old weights' KV is not even looked at, and the
   outputs equal an engine's computing under the new weights. (test_engine_embedded.py's negative control
   shows that the same KV, when loaded, does change the outputs.)
"""

from __future__ import annotations

import pytest
from .enginekit import BLOCK, Engines, Reference, assert_same, build_model, connector, prompt_tokens

pytestmark = pytest.mark.slow

P = prompt_tokens(11)
A, B = P + [5, 6, 7], P + [8, 9]
FULL = (len(P) // BLOCK) * BLOCK


def test_restart_with_default_on_evict_serves_prefix_from_disk(engines: Engines, model, reference: Reference,
                                                                 work):
    root = work / "durable-restart"
    config = connector({"dram_capacity": "64MiB", "ssd_path": str(root / "ssd"), "ssd_capacity": "64MiB",
                        "ipc_dir": str(root)})  # ssd_offload left at its default: on_evict
    root.mkdir()
    first = engines.start("durable-first", model, config)
    assert first.generate([A])[0]["cached"] == 0
    (store,) = first.store_stats()
    assert store["offload"]["policy"] == "on_evict" and store["tiers"]["dram"]["evictions"] == 0
    assert first.close() == 0  # clean shutdown: DRAM's blocks must reach the disk now
    second = engines.start("durable-second", model, config)
    before = second.metrics()
    b = second.generate([B])[0]
    after = second.metrics()
    assert b["cached"] == FULL
    name = "vllm:prompt_tokens_cached_by_source{source=disk}"
    assert after.get(name, 0) - before.get(name, 0) == FULL
    assert_same(b, reference(B))
    assert second.close() == 0


def test_kv_under_changed_weights_is_not_loaded(engines: Engines, engine_py, work):
    root = work / "durable-weights"
    model = build_model(engine_py, root / "llama", seed=0)
    config = connector({"dram_capacity": "64MiB", "ssd_path": str(root / "ssd"), "ssd_capacity": "64MiB",
                        "ssd_offload": "write_through", "ipc_dir": str(root)})
    old = engines.start("durable-w1", model, config)
    old.generate([A])
    assert old.close() == 0
    build_model(engine_py, model, seed=1)  # new weights at the same path
    new = engines.start("durable-w2", model, config)
    fresh = engines.start("durable-ref-w2", build_model(engine_py, root / "llama-w2", seed=1))
    b = new.generate([B])[0]
    assert b["cached"] == 0  # the old weights' KV lives under another namespace now: not even looked at
    assert_same(b, fresh.generate([B])[0])
