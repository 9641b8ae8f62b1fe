"""The replay's report: a table on stdout and a JSON document (its schema is in ``to_json``'s docstring)."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from typing import Any

from kvtier.tools.replay.replayer import HBM
from kvtier.tools.replay.sweep import PolicyRun, Sweep, SweepPoint
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
        "model": {"name": sweep.model, "block_bytes": sweep.block_bytes, "layout": sweep.layout.fingerprint,
                  "slot_bytes": sweep.unit_bytes,
                  **({"hybrid": hybrid_setup(sweep)} if sweep.hybrid is not None else {})},
        "replay": {**asdict(cfg), "lanes": None if w.timed else cfg.lanes},
        "service": {"prefill_tokens_per_s": svc.prefill_tokens_per_s, "decode_tokens_per_s": svc.decode_tokens_per_s,
                    "tier_bytes_per_s": dict(svc.tier_bytes_per_s)},
    }


def hybrid_setup(sweep: Sweep) -> dict[str, Any]:
    m, obj = sweep.hybrid, sweep.objects
    assert m is not None and obj is not None
    return {"full_bytes_per_token": m.full_bytes_per_token, "state_bytes": m.state_bytes,
            "windows": [{"name": g.name, "bytes_per_token": g.bytes_per_token, "window": g.window,
                         "tail_blocks": t} for g, t in zip(m.windows, obj.tails)],
            "interval_tokens": m.interval_tokens, "slot_rounding": obj.rounding(m), "source": m.source}


def hybrid_json(r: Any) -> dict[str, Any]:
    """A hybrid run's bytes: per group stored and loaded, and stored per input token against every group whole."""
    stored = sum(r.group_bytes_stored.values())
    n = r.input_tokens or 1
    return {"group_bytes_stored": dict(r.group_bytes_stored), "group_bytes_loaded": dict(r.group_bytes_loaded),
            "whole_bytes_stored": r.whole_bytes_stored, "stored_per_input_token": stored / n,
            "whole_per_input_token": r.whole_bytes_stored / n,
            "stored_vs_whole": stored / r.whole_bytes_stored if r.whole_bytes_stored else None}


def policy_json(run: PolicyRun, block_bytes: int) -> dict[str, Any]:
    r = run.result
    return {
        **({"hybrid": hybrid_json(r)} if r.group_bytes_stored else {}),
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
        # per lower tier: seconds of its read channel held by demand loads and by prefetches, and their share
        # of the replay's span (near 1: the tier's bandwidth, not the prefetch, bounds the turns)
        "channel_s": {t: {**c, "busy_share": (c["demand"] + c["prefetch"]) / r.virtual_s if r.virtual_s else 0.0}
                      for t, c in r.channel_s.items()},
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
    A hybrid model's run (storing only what can be used) adds ``"hybrid"`` to each policy: ``group_bytes_stored``
    and ``group_bytes_loaded`` (real bytes per cache group), ``whole_bytes_stored`` (every group of the same
    blocks stored whole), ``stored_per_input_token``, ``whole_per_input_token`` and ``stored_vs_whole``; its
    ``model`` names the groups (``"hybrid"``) and ``slot_bytes`` (what one store slot stands for).
    The top level repeats the first point's fields, so a single-capacity run reads
    ``{"policies": ..., "opt_hit_rate": ..., "infinite_hit_rate": ...}``.
    """
    pts = [point_json(p, sweep.unit_bytes) for p in points]
    return {**setup(sweep), **(pts[0] if pts else {}), "points": pts}


def print_table(sweep: Sweep, points: list[SweepPoint], title: str = "kvtier replay") -> None:
    w, cfg = sweep.workload, sweep.config
    bb = sweep.block_bytes
    unique = w.unique_blocks
    print(f"\n{title}: {w.describe()}")
    how = ("requests at their timestamps" if w.timed
           else f"{cfg.lanes} lanes, think time capped at {cfg.think_cap_s:g} s")
    share = "" if sweep.share_bytes == bb else (f" ({format_bytes(sweep.share_bytes)} of full-history groups: "
                                                f"what a capacity's percentage counts)")
    print(f"  {sweep.model}: {format_bytes(bb)} per {w.block_tokens}-token block{share}; unique blocks "
          f"{format_bytes(unique * sweep.share_bytes)}; {how}; offload {cfg.offload}; HBM {sweep.label(sweep.hbm)}")
    if sweep.hybrid is not None and sweep.objects is not None:
        m, obj = sweep.hybrid, sweep.objects
        print(f"  hybrid, storing only what can be used: {m.describe(w.block_tokens)}; a store slot is "
              f"{format_bytes(obj.unit_bytes)} (objects rounded to slots within {obj.rounding(m):.1%}); "
              f"capacities are shares of the full-history groups' unique blocks")
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
    if sweep.hybrid is not None:
        _print_hybrid_bytes(points)
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


def _print_hybrid_bytes(points: list[SweepPoint]) -> None:
    """Per run: bytes stored per input token by group, against storing every group of the same blocks whole."""
    names = list(next(iter(points[0].runs.values())).result.group_bytes_stored)
    lower = [t for t in points[0].capacity_blocks if t != HBM]
    print("\n" + "".join(f"{t + ' size':>20}" for t in lower) + f"  {'policy':<10}{'stored/tok':>11}"
          + "".join(f"{g:>15}" for g in names) + f"{'whole/tok':>11}{'ratio':>7}{'loaded/tok':>11}")
    for point in points:
        label = "".join(f"{point.labels.get(t, ''):>20}" for t in lower)
        for name, run in point.runs.items():
            r = run.result
            n = r.input_tokens or 1
            stored = sum(r.group_bytes_stored.values())
            ratio = stored / r.whole_bytes_stored if r.whole_bytes_stored else 0.0
            print(f"{label}  {name:<10}{format_bytes(stored / n):>11}"
                  + "".join(f"{format_bytes(r.group_bytes_stored[g] / n):>15}" for g in names)
                  + f"{format_bytes(r.whole_bytes_stored / n):>11}{ratio:>7.3f}"
                  + f"{format_bytes(sum(r.group_bytes_loaded.values()) / n):>11}")
            label = " " * len(label)
    print("stored/tok: bytes written to the store per input token (only what can be used: full-history blocks, "
          "and state and window tails at checkpoints), per group after it;\nwhole/tok: every group of the same "
          "blocks stored whole; loaded/tok: bytes read from the store per input token.")


def _pf_bytes(r: Any, what: str, block_bytes: int) -> str:
    return format_bytes(r.prefetch.get(what, 0) * block_bytes) if r.prefetch else "-"


def _tokens(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)
