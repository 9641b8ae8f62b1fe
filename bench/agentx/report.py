"""What ``kvtier bench agentx`` reports from one run: latency percentiles, throughput, the server's prompt-token
counters (computed vs cached by source), the cache model's hit rate for the same request stream, the table,
AIPerf's export files and the throughput-vs-interactivity plot.

**Measured vs modeled hit rate.** The measured rate is the server's: prompt tokens cached (vLLM's
``prompt_tokens_cached_by_source``: device = its own prefix cache in HBM, host/disk = kvtier's tiers) over
prompt tokens, in the window. The modeled one replays the exact requests this run sent, in the order they were
sent, through the replay's HBM model (kvtier.tools.replay.hbm.HbmPrefixCache, an LRU of blocks whose held prefix is
free) with the engine's real block count, and for a kvtier mode a second LRU of kvtier's DRAM size fed
write-through. They differ where the model is simpler than the engine: the model admits a request's blocks at
once, while the engine holds a running request's blocks (and its decode blocks) pinned and frees them only
when it finishes, so concurrent requests squeeze HBM harder; vLLM preempts and recomputes under pressure; the
model's DRAM is LRU, kvtier's default policy is not; requests cut at the window's end count in the model only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.agentx.loop import LoopResult, Sent
from kvtier.bench.serve_proc import labelled
from kvtier.tools.replay.hbm import HbmPrefixCache

PROMPT = "vllm:prompt_tokens_total"
GENERATED = "vllm:generation_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # local_compute, local_cache_hit, external_kv_transfer
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"  # device, host, disk, p2p, external_unspecified


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if len(values) else None


def gpu_blocks(metrics: dict[str, float]) -> int | None:
    """The engine's KV block count (vLLM's ``cache_config_info`` label)."""
    got = labelled(metrics, "vllm:cache_config_info", "num_gpu_blocks")
    return int(float(next(iter(got)))) if got else None


def modeled(loop: LoopResult, hbm_blocks: int, dram_blocks: int, block_tokens: int) -> dict[str, Any]:
    """The cache model over the requests this run sent (see the module's doc); rates over the window's prompt
    tokens."""
    hbm = HbmPrefixCache(hbm_blocks)
    dram = HbmPrefixCache(dram_blocks) if dram_blocks else None
    hits = {"hbm": 0, "dram": 0}
    prompt = 0
    for s in sorted(loop.sent, key=lambda s: s.sent):
        h = hbm.prefix(s.keys)
        d = dram.prefix(s.keys[h:]) if dram is not None else 0
        if s.phase == "window" and s.result is not None:
            hits["hbm"] += h * block_tokens
            hits["dram"] += d * block_tokens
            prompt += s.prompt_len
        hbm.admit(s.keys)
        if dram is not None:
            dram.admit(s.keys)
    rate = {k: round(v / prompt, 4) if prompt else 0.0 for k, v in hits.items()}
    return {**rate, "total": round(sum(rate.values()), 4)}


def summarize(mode: str, lanes: int, loop: LoopResult, after: dict[str, float], block_tokens: int,
              dram_bytes: int) -> dict[str, Any]:
    """One run's row (see the module's doc for the hit rates)."""
    window = [s for s in loop.sent if s.phase == "window"]
    done = [s for s in window if s.result is not None]
    records = [_record(s) for s in done]
    ttft = [r["ttft_ms"] for r in records if r["ttft_ms"] is not None]
    itl = [r["itl_ms"] for r in records if r["itl_ms"] is not None]
    d = delta(after, loop.metrics_before)
    secs = max(loop.window_end - loop.window_start, 1e-9)
    prompt, generated = d.get(PROMPT, 0.0), d.get(GENERATED, 0.0)
    cached = {k: int(v) for k, v in labelled(d, CACHED_BY_SOURCE, "source").items() if v}
    blocks = gpu_blocks(after) or 0
    block_bytes = _block_bytes(after, blocks)
    dram_blocks = dram_bytes // block_bytes if dram_bytes and block_bytes else 0
    unique = len({k for s in window for k in s.keys})
    return {
        "mode": mode, "concurrency": lanes, "window_s": round(secs, 2),
        "requests": {"completed": len(done), "failed": sum(1 for s in window if s.error and not s.cut),
                     "cut_at_end": sum(1 for s in window if s.cut),
                     "warmup_sent": sum(1 for s in loop.sent if s.phase == "warmup"),
                     "warmup_lanes_cut": loop.warmup_cut},
        "errors": sorted({s.error for s in window if s.error and not s.cut})[:5],
        "prompt_tokens": int(prompt),
        "prompt_tokens_computed": int(labelled(d, BY_SOURCE, "source").get("local_compute", 0.0)),
        "prompt_tokens_cached": cached,
        "kvtier_cached_tokens": sum(v for k, v in cached.items() if k != "device"),
        "measured_hit_rate": round(sum(cached.values()) / prompt, 4) if prompt else 0.0,
        "modeled_hit_rate": modeled(loop, blocks, dram_blocks, block_tokens) if blocks else None,
        "hbm_blocks": blocks, "window_unique_blocks": unique,
        "hbm_fraction": round(blocks / unique, 4) if unique else None,
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90)},
        "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90)},
        "interactivity_tok_s": interactivity(itl),
        "total_tokens_per_s": round((prompt + generated) / secs, 2),
        "output_tokens_per_s": round(generated / secs, 2),
        "server_died_at_s": loop.server_died_at, "notes": loop.notes,
        "_records": records,
    }


def _block_bytes(metrics: dict[str, float], blocks: int) -> int:
    """Bytes of one KV block: the configured KV memory over the block count (vLLM sizes it so)."""
    got = labelled(metrics, "vllm:cache_config_info", "kv_cache_memory_bytes")
    total = next((float(k) for k in got if k not in ("None", "")), 0.0) if got else 0.0
    return int(total // blocks) if total and blocks else 0


def interactivity(itl_ms: Sequence[float]) -> dict[str, float | None]:
    """Per-user output tokens/s at the latency percentiles: p50 = 1/ITL p50; p90 = 1/ITL p90, the rate 90% of
    requests reach (the tail, as TTFT's p90 is; the 90th percentile of the rates would be the lucky tenth)."""
    out: dict[str, float | None] = {}
    for q in (50, 90):
        v = pct(itl_ms, q)
        out[f"p{q}"] = round(1e3 / v, 2) if v else None
    return out


def _record(s: Sent) -> dict[str, Any]:
    """One completed request. ITL as AIPerf defines it, (last token - first token) / (output tokens - 1), with
    the output tokens the server's usage counted: a stream event may carry more than one token."""
    r = s.result
    ev = r.events
    osl = r.completion_tokens or len(ev)
    return {"ttft_ms": (ev[0] - s.sent) * 1e3 if ev else None, "latency_ms": (r.done - s.sent) * 1e3,
            "itl_ms": (ev[-1] - ev[0]) / (osl - 1) * 1e3 if ev and osl > 1 else None,
            "isl": r.prompt_tokens or s.prompt_len, "osl": osl,
            "cached_tokens": r.cached_tokens, "sent": s.sent, "done": r.done, "lane": s.lane}


def compare(rows: list[dict[str, Any]], baseline: str = "none") -> None:
    """Each row beside the connector-less row of its concurrency: ratios of computed tokens and TTFT p50."""
    base = {r["concurrency"]: r for r in rows if r["mode"] == baseline}
    for r in rows:
        b = base.get(r["concurrency"])
        if b is None or r is b:
            continue
        ratio = {}
        if b["prompt_tokens_computed"]:
            ratio["computed"] = round(r["prompt_tokens_computed"] / b["prompt_tokens_computed"], 3)
        if b["ttft_ms"]["p50"] and r["ttft_ms"]["p50"] is not None:
            ratio["ttft_p50"] = round(r["ttft_ms"]["p50"] / b["ttft_ms"]["p50"], 3)
        if b["total_tokens_per_s"]:
            ratio["total_tokens_per_s"] = round(r["total_tokens_per_s"] / b["total_tokens_per_s"], 3)
        r["vs_" + baseline] = ratio


def print_table(rows: list[dict[str, Any]], unavailable: dict[str, str]) -> None:
    print("\nagentic sessions, closed loop, real server (window figures; baseline: the connector-less engine at the "
          "same concurrency, same run, same seed; ratio = mode / none)")
    print(f"{'mode':>11}{'conc':>5}{'done':>6}{'prompt':>9}{'computed':>10}{'cached (by source)':>36}"
          f"{'hit meas/model':>16}{'hbm/uniq':>9}{'TTFT p50':>10}{'p90':>9}{'inter p90':>10}{'tok/s':>8}"
          f"{'comp ratio':>11}{'TTFT ratio':>11}")
    for r in rows:
        cached = ",".join(f"{k}={v}" for k, v in sorted(r["prompt_tokens_cached"].items())) or "-"
        m = r["modeled_hit_rate"] or {}
        vs = r.get("vs_none", {})
        print(f"{r['mode']:>11}{r['concurrency']:>5}{r['requests']['completed']:>6}{r['prompt_tokens']:>9}"
              f"{r['prompt_tokens_computed']:>10}{cached:>36}"
              f"{r['measured_hit_rate']:>8.3f}/{m.get('total', 0):<7.3f}{_f(r['hbm_fraction'], 9, 3)}"
              f"{_f(r['ttft_ms']['p50'], 10, 0)}{_f(r['ttft_ms']['p90'], 9, 0)}"
              f"{_f(r['interactivity_tok_s']['p90'], 10, 1)}{r['total_tokens_per_s']:>8.0f}"
              f"{_f(vs.get('computed'), 11, 3)}{_f(vs.get('ttft_p50'), 11, 3)}")
        for note in r["notes"]:
            print(f"{'':>16}note: {note}")
    for mode, why in unavailable.items():
        print(f"{mode:>11}  did not run: {why}")


def _f(v: float | None, width: int, digits: int) -> str:
    return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


# ---- AIPerf's export format -----------------------------------------------------------------------------

def _stats(values: Sequence[float], unit: str) -> dict[str, Any]:
    if not len(values):
        return {"unit": unit}
    a = np.asarray(values, dtype=float)
    out = {"unit": unit, "avg": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
           "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "count": int(len(a))}
    out.update({f"p{q}": float(np.percentile(a, q)) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99)})
    return out


def write_aiperf(row: dict[str, Any], directory: Path, config: dict[str, Any]) -> Path:
    """AIPerf's files for one run: ``profile_export_aiperf.json`` (a stats block per metric, under AIPerf's
    metric tags) and ``profile_export.jsonl`` (one record per request), so they sit beside AgentX results."""
    directory.mkdir(parents=True, exist_ok=True)
    recs = row["_records"]
    ttft = [r["ttft_ms"] for r in recs if r["ttft_ms"] is not None]
    itl = [r["itl_ms"] for r in recs if r["itl_ms"] is not None]
    per_user = [1e3 / v for v in itl if v > 0]
    secs = row["window_s"]
    summary = {
        "time_to_first_token": _stats(ttft, "ms"),
        "inter_token_latency": _stats(itl, "ms"),
        "output_token_throughput_per_user": _stats(per_user, "tokens/sec/user"),
        "request_latency": _stats([r["latency_ms"] for r in recs], "ms"),
        "input_sequence_length": _stats([r["isl"] for r in recs], "tokens"),
        "output_sequence_length": _stats([r["osl"] for r in recs], "tokens"),
        "request_throughput": {"unit": "requests/sec", "avg": len(recs) / secs},
        "output_token_throughput": {"unit": "tokens/sec", "avg": row["output_tokens_per_s"]},
        "total_token_throughput": {"unit": "tokens/sec", "avg": row["total_tokens_per_s"]},
        "request_count": {"unit": "requests", "avg": len(recs)},
        "error_request_count": {"unit": "requests", "avg": row["requests"]["failed"]},
        "benchmark_duration": {"unit": "sec", "avg": secs},
        "input_config": {**config, "concurrency": row["concurrency"], "kvtier_mode": row["mode"]},
        "kvtier": {k: v for k, v in row.items() if not k.startswith("_")},
    }
    (directory / "profile_export_aiperf.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(directory / "profile_export.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps({
                "metadata": {"session_num": r["lane"], "request_start_ns": int(r["sent"] * 1e9),
                             "request_end_ns": int(r["done"] * 1e9), "benchmark_phase": "profiling"},
                "metrics": {"time_to_first_token": {"value": r["ttft_ms"], "unit": "ms"},
                            "inter_token_latency": {"value": r["itl_ms"], "unit": "ms"},
                            "request_latency": {"value": r["latency_ms"], "unit": "ms"},
                            "input_sequence_length": {"value": r["isl"], "unit": "tokens"},
                            "output_sequence_length": {"value": r["osl"], "unit": "tokens"},
                            "cached_tokens": {"value": r["cached_tokens"], "unit": "tokens"}}}) + "\n")
    return directory


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Total tokens/s against per-user output tokens/s (p50), one curve per mode across concurrencies."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["concurrency"], r["interactivity_tok_s"]["p50"], r["total_tokens_per_s"])
                     for r in rows if r["mode"] == mode and r["interactivity_tok_s"]["p50"] is not None)
        if not pts:
            continue
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=mode)
        for c, x, y in pts:
            ax.annotate(f"{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity: output tokens/s per user (p50)")
    ax.set_ylabel("total tokens/s (prompt + output)")
    ax.set_title("kvtier bench agentx: throughput vs interactivity (labels: sessions)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
