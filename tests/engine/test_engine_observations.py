"""Session observations (``store.observe``) fed from the vLLM connector's scheduler reach a real engine's store.

The hints travel in ``kv_transfer_params`` (``extra_body`` of an OpenAI request; test_engine_serve shows they
reach the connector through ``vllm serve``); here the engine is driven offline so the test can read the
worker's store: ``stats()["observations"]`` counts arrivals, completions and hints and lists the turns per
client session.
"""

from __future__ import annotations

from typing import Any

import pytest
from .enginekit import Engines, Reference, assert_same, connector, prompt_tokens

pytestmark = pytest.mark.slow

P = prompt_tokens(12)


def observed_turns(stats: dict[str, Any], session: str) -> int:
    return int(stats.get("observations", {}).get("sessions", {}).get(session, {}).get("turns", 0))


def test_session_observations_reach_the_store(engines: Engines, model, reference: Reference, work):
    root = work / "observations"
    root.mkdir()
    e = engines.start("observe", model, connector({"dram_capacity": "64MiB", "ipc_dir": str(root)}))
    hint = {"kvtier": {"session": "agent-9", "ttl_s": 120, "priority": 1}}
    first = e.generate([P + [5]], kv_transfer_params=hint)[0]
    second = e.generate([P + [5] + first["tokens"] + [6]], kv_transfer_params=hint)[0]  # the next turn
    e.generate([prompt_tokens(13)])  # no session: not observed as agent-9
    assert second["cached"] > 0
    assert_same(second, reference(P + [5] + first["tokens"] + [6]))
    (stats,) = e.store_stats()
    assert observed_turns(stats, "agent-9") == 2
    seen = stats["observations"]
    # Three requests arrived and finished (the unhinted one too: it is observed, as an inferred agent), and the
    # two hinted turns carried their hints.
    assert seen["arrivals"] == 3 and seen["completions"] == 3 and seen["hints"] >= 2
