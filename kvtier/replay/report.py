"""The replay's report: a table on stdout and a JSON document (its schema is in ``to_json``'s docstring)."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from typing import Any

from kvtier.replay.replayer import HBM
from kvtier.replay.sweep import PolicyRun, Sweep, SweepPoint
from kvtier.units import format_bytes

# Prefill utilization above which the modeled server is saturated: queues grow, TTFT is minutes, and a ranking
# of policies is decided in the drain at the end rather than in steady state.
SATURATED = 0.9


def utilization(r: Any) -> float:
    """The modeled GPU's prefill utilization over a replay (a ReplayResult)."""
    return r.prefill_busy_s / r.virtual_s if r.virtual_s else 0.0


def setup(sweep: Sweep) -> dict[str, Any]:
    """What was replayed and how: enough to rerun it."""
    w, cfg, svc = sweep.workload, sweep.config, sweep.service
    return {
        "workload": {"source": w.source, "traces": len(w.traces), "timed": w.timed, "repeat": w.repeat,
                     "seed": w.seed, "requests": w.requests, "input_tokens": w.input_tokens,
                     "unique_blocks": w.unique_blocks, "block_accesses": w.block_accesses,
                     "block_tokens": w.block_tokens},
        "model": {"name": sweep.model, "block_bytes": sweep.block_bytes, "layout": sweep.layout.fingerprint},
        "replay": {**asdict(cfg), "lanes": None if w.timed else cfg.lanes},
        "service": {"prefill_tokens_per_s": svc.prefill_tokens_per_s, "decode_tokens_per_s": svc.decode_tokens_per_s,
                    "tier_bytes_per_s": dict(svc.tier_bytes_per_s)},
    }


def policy_json(run: PolicyRun, block_bytes: int) -> dict[str, Any]:
    r = run.result
    return {
        "hit_rate": r.hit_rate,
        "tier_hit_rate": r.tier_hit_rate,
        "opt_hit_rate": run.opt_hit_rate,
        "opt_dram_only_hit_rate": run.opt_dram_only_hit_rate,
        "infinite_hit_rate": run.infinite_hit_rate,
        "prefill_tokens_saved": sum(r.hit_tokens.values()),
        "prefill_tokens_saved_by_store": r.store_saved_tokens,
        "tokens": {"input": r.input_tokens, "computed": r.computed_tokens, "hit": dict(r.hit_tokens)},
        "bytes_loaded": dict(r.bytes_loaded),
        "bytes_stored": dict(r.bytes_stored),
        "ttft_s": {"p50": r.ttft_percentile(50), "p90": r.ttft_percentile(90)},
        "dram_share_of_store_hits": r.dram_share,
        "prefetch_blocks": dict(r.prefetch),
        "prefetch_bytes": {k: v * block_bytes for k, v in r.prefetch.items()},
        "requests": r.requests,
        "lost_blocks": r.lost_blocks,
        "virtual_s": r.virtual_s,
        "prefill_utilization": utilization(r),
        "saturated": utilization(r) > SATURATED,
        "cpu_s": r.cpu_s,
        "requests_per_cpu_s": r.requests / r.cpu_s if r.cpu_s else None,
        "opt_cpu_s": run.opt_cpu_s,
    }


def point_json(point: SweepPoint, block_bytes: int) -> dict[str, Any]:
    return {
        "capacities": {t: {"blocks": b, "bytes": b * block_bytes, "label": point.labels.get(t, "")}
                       for t, b in point.capacity_blocks.items()},
        "policies": {name: policy_json(run, block_bytes) for name, run in point.runs.items()},
        "opt_hit_rate": point.opt_hit_rate,
        "opt_dram_only_hit_rate": point.opt_dram_only_hit_rate,
        "infinite_hit_rate": point.infinite_hit_rate,
    }


def to_json(sweep: Sweep, points: list[SweepPoint]) -> dict[str, Any]:
    """The report as one JSON object.

    ``points``: one object per capacity combination, in the order given on the command line, each
    ``{"capacities": {TIER: {"blocks", "bytes", "label"}}, "policies": {NAME: {"hit_rate", "tier_hit_rate":
    {TIER: ...}, "opt_hit_rate", "infinite_hit_rate", ...}}, "opt_hit_rate", "infinite_hit_rate"}``. Hit rates
    are fractions of input tokens. A policy's ``opt_hit_rate`` is Belady's optimum on its own request order (the
    order depends on service times, so on hits) at HBM + store capacity; a point's is the largest of those, so
    it bounds every policy. ``opt_dram_only_hit_rate`` is the same optimum at the store's capacity alone
    (HBM left out: with write-through, HBM's blocks are in DRAM too). ``prefill_utilization`` is the modeled
    GPU's busy share; ``saturated`` is true above 90%.
    The top level repeats the first point's fields, so a single-capacity run reads
    ``{"policies": ..., "opt_hit_rate": ..., "infinite_hit_rate": ...}``.
    """
    pts = [point_json(p, sweep.block_bytes) for p in points]
    return {**setup(sweep), **(pts[0] if pts else {}), "points": pts}


def print_table(sweep: Sweep, points: list[SweepPoint], title: str = "kvtier replay") -> None:
    w, cfg = sweep.workload, sweep.config
    bb = sweep.block_bytes
    unique = w.unique_blocks
    print(f"\n{title}: {w.describe()}")
    how = ("requests at their timestamps" if w.timed
           else f"{cfg.lanes} lanes, think time capped at {cfg.think_cap_s:g} s")
    print(f"  {sweep.model}: {format_bytes(bb)} per {w.block_tokens}-token block; unique blocks "
          f"{format_bytes(unique * bb)}; {how}; offload {cfg.offload}; HBM {sweep.hbm.label(unique, bb)}")
    svc = sweep.service
    print(f"  service model: prefill {svc.prefill_tokens_per_s:,.0f} tok/s, decode {svc.decode_tokens_per_s:g} tok/s, "
          + ", ".join(f"{t} {v / 1e9:g} GB/s" for t, v in svc.tier_bytes_per_s.items()))
    if not points:
        return
    tiers = list(points[0].capacity_blocks)
    lower = [t for t in tiers if t != HBM]
    head = "".join(f"{t + ' size':>20}" for t in lower) + f"  {'policy':<10}{'hit':>7}"
    head += "".join(f"{t:>7}" for t in tiers)
    head += f"{'OPT':>7}{'OPTd':>7}{'inf':>7}{'saved':>9}{'loaded':>11}{'stored':>11}{'TTFT p50':>10}{'p90':>8}{'busy':>6}"
    head += f"{'inDRAM':>7}{'prefetch':>10}{'wasted':>10}{'req/CPU-s':>10}"
    print("\n" + head)
    saturated = False
    for point in points:
        caps = "".join(f"{point.labels.get(t, ''):>20}" for t in lower)
        for name, run in point.runs.items():
            r = run.result
            rates = "".join(f"{r.tier_hit_rate.get(t, 0.0):>7.3f}" for t in tiers)
            loaded, stored = sum(r.bytes_loaded.values()), sum(r.bytes_stored.values())
            util = utilization(r)
            saturated = saturated or util > SATURATED
            rps = r.requests / r.cpu_s if r.cpu_s else math.inf
            print(f"{caps}  {name:<10}{r.hit_rate:>7.3f}{rates}{run.opt_hit_rate:>7.3f}"
                  f"{run.opt_dram_only_hit_rate:>7.3f}{run.infinite_hit_rate:>7.3f}"
                  f"{_tokens(r.store_saved_tokens):>9}{format_bytes(loaded):>11}{format_bytes(stored):>11}"
                  f"{r.ttft_percentile(50):>9.2f}s{r.ttft_percentile(90):>7.1f}s{util:>6.0%}"
                  f"{r.dram_share:>7.0%}{_pf_bytes(r, 'prefetched', bb):>10}{_pf_bytes(r, 'wasted', bb):>10}{rps:>10.0f}")
            caps = " " * len(caps)
    print("\nhit: input tokens served from cache (per tier after it); OPT: Belady's optimum at the same total "
          "capacity (HBM + store) on the same request order;\nOPTd: the same at the store's capacity alone (HBM "
          "left out; DRAM-only for a DRAM store); inf: infinite cache; saved: prefill tokens loaded from below HBM;"
          "\nbusy: prefill utilization of the modeled GPU; inDRAM: share of the hits below HBM that were in DRAM when their "
          "request arrived;\nprefetch, wasted: bytes brought up into DRAM between turns, and those evicted unused "
          "(- : prefetch off).")
    if saturated:
        print(f"\nwarning: the modeled server is saturated (busy above {SATURATED:.0%}): requests queue for minutes "
              "and the ranking of policies is decided in the drain at the end; compare them also where busy stays "
              "below ~70% (fewer --lanes, or a faster --prefill-rate)", file=sys.stderr)


def _pf_bytes(r: Any, what: str, block_bytes: int) -> str:
    return format_bytes(r.prefetch.get(what, 0) * block_bytes) if r.prefetch else "-"


def _tokens(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)
