"""``vllm serve`` (vLLM's OpenAI server) with kvtier, called as a client would: the ``openai`` package, kvtier's
agent hints in ``extra_body={"kv_transfer_params": {"kvtier": {...}}}``.

The hint must reach the worker's store: a session's prefix sent with ``ttl_s`` stays pinned while other
prompts fill kvtier's small DRAM and evict everything unpinned, so after vLLM's own prefix cache is reset
the session's next turn still loads its prefix from kvtier, while a prefix sent without a hint at the same
time was evicted (the control: the hint, not luck, kept it). Outputs (greedy tokens, logprobs through JSON)
equal the engine's without the connector.
"""

from __future__ import annotations

import re

import pytest
from .enginekit import BLOCK, MAX_TOKENS, Reference, ServeProcess, connector, prompt_tokens

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai", reason="the openai client is installed with vLLM's requirements")

HINTED, PLAIN = prompt_tokens(6), prompt_tokens(7)
FILLERS = [prompt_tokens(s) for s in (8, 9, 10)]
FULL = (len(HINTED) // BLOCK) * BLOCK
HINT = {"kvtier": {"session": "agent-7", "ttl_s": 600, "priority": 1}}


@pytest.fixture(scope="module")
def server(engine_py, model, work):
    root = work / "serve"
    root.mkdir()
    # 96 blocks of DRAM: the hinted prefix (31, under the 48 that hint_max_fraction 0.5 allows) plus room for
    # two more prefixes; five prefixes pass through it.
    kv = connector({"dram_capacity": "3MiB", "ipc_dir": str(root)})
    s = ServeProcess(engine_py, model, log=work / "logs" / "serve.log", kv_config=kv)
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def complete(client, model: str, prompt: list[int], kv_transfer_params: dict | None = None):
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                  extra_body=extra)
    choice = r.choices[0]
    tokens = [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]
    cached = (r.usage.prompt_tokens_details.cached_tokens or 0) if r.usage.prompt_tokens_details else 0
    return {"tokens": tokens, "logprobs": list(choice.logprobs.token_logprobs), "cached": cached}


def counter(metrics_text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics_text, re.M):
        total += float(m.group(1))
    return total


def test_vllm_serve_hints_pin_a_session_and_outputs_equal(server: ServeProcess, reference: Reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)
    model = server.model
    first = complete(client, model, HINTED + [5], HINT)
    assert first["cached"] == 0
    assert first["tokens"] == reference(HINTED + [5])["tokens"]
    complete(client, model, PLAIN + [5])
    for f in FILLERS:
        complete(client, model, f + [5])
    server.post("/reset_prefix_cache")  # vLLM forgets its own (HBM) prefix cache
    before = counter(server.get_text("/metrics"), "vllm:external_prefix_cache_hits_total")
    turn2 = complete(client, model, HINTED + [6, 7], HINT)
    plain2 = complete(client, model, PLAIN + [6, 7])
    after = counter(server.get_text("/metrics"), "vllm:external_prefix_cache_hits_total")
    assert turn2["cached"] == FULL  # the pinned session prefix survived the fillers, loaded from kvtier
    assert plain2["cached"] == 0  # the control: the same age, no hint, evicted
    assert after - before == FULL
    for got, prompt in ((turn2, HINTED + [6, 7]), (plain2, PLAIN + [6, 7])):
        want = reference(prompt)
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == want["logprobs"]
