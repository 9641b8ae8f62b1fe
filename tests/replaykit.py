"""Builders for small hand-made traces, shared by the replay tests (no files under /work/shared needed)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from hypothesis import strategies as st

from kvtier.tools.replay.hybrid import HybridModel
from kvtier.tools.replay.replayer import ReplayConfig
from kvtier.tools.replay.service import ServiceModel
from kvtier.tools.replay.sizing import model_layout, parse_capacity
from kvtier.tools.replay.sweep import PolicyRun, Sweep
from kvtier.tools.replay.traces import Trace, parse_agentic
from kvtier.tools.replay.workload import Workload

BT = 64  # tokens per block in agentic-cc traces
# A tiny explicit model: 1 layer, 1 KV head, head dim 8, bf16 -> 2 KiB per 64-token block.
MODEL = dict(layers=1, kv_heads=1, head_dim=8)


def req(ids: Sequence[int], think: float = 0.0, out: int = 10, extra_tokens: int = 0, t: float = 0.0,
        api: float = 1.0, stop: str | None = None) -> dict[str, Any]:
    """A request whose input is exactly its blocks (plus ``extra_tokens`` of a trailing partial block)."""
    r = {"t": t, "type": "n", "in": len(ids) * BT + extra_tokens, "out": out, "hash_ids": list(ids),
         "think_time": think, "api_time": api}
    if stop is not None:
        r["stop"] = stop
    return r


def sub(requests: list[dict[str, Any]], t: float, duration: float) -> dict[str, Any]:
    """A subagent entry; ``t`` is when it finished, as in the captured traces."""
    return {"t": t, "type": "subagent", "duration_ms": duration * 1000, "requests": requests}


def trace(name: str, requests: list[dict[str, Any]]) -> Trace:
    return parse_agentic({"id": name, "block_size": BT, "requests": requests}, name)


def sweep(traces: list[Trace], lanes: int = 1, offload: str = "write-through", prefill: float = 1e9,
          decode: float = 1e9, bandwidth: float = 1e18, think_cap: float = 60.0, seed: int = 0,
          extra: dict[str, Any] | None = None, sessions: bool = False, hints: bool = False,
          hybrid: HybridModel | None = None) -> Sweep:
    """A sweep of ``traces`` with the tiny explicit model, or ``hybrid`` (its store slots are its full-history
    blocks: see hybrid_replay.py)."""
    if hybrid is None:
        name, layout, _ = model_layout(None, BT, **MODEL)
    else:
        name, layout = hybrid.name, hybrid.layout(BT)
    service = ServiceModel(prefill, decode, {"dram": bandwidth, "ssd": bandwidth / 4})
    config = ReplayConfig(lanes=lanes, think_cap_s=think_cap, offload=offload, sessions=sessions, hints=hints)
    workload = Workload(traces, seed=seed, source="test")
    return Sweep(workload, layout, name, parse_capacity("0"), {"dram_capacity": [parse_capacity("0")]},
                 ["lru"], service, config, extra, hybrid=hybrid)


def replay(sw: Sweep, policy: str, hbm_blocks: int, dram_blocks: int, record: bool = False,
           **lower_blocks: int) -> PolicyRun:
    """One run; ``lower_blocks``: other tiers by config key, e.g. ``ssd_capacity=8``."""
    return sw.run_one(policy, hbm_blocks, {"dram_capacity": dram_blocks, **lower_blocks}, record=record)


def brute_force_opt(stream: list[int], capacity: int) -> int:
    """The most hits any cache of ``capacity`` blocks can get, by trying every keep/evict choice."""

    @lru_cache(maxsize=None)
    def best(t: int, cache: frozenset) -> int:
        if t == len(stream):
            return 0
        b = stream[t]
        if b in cache:
            return 1 + best(t + 1, cache)
        options = [cache]  # bypass
        if len(cache) < capacity:
            options.append(cache | {b})
        else:
            options += [(cache - {x}) | {b} for x in cache]
        return max(best(t + 1, c) for c in options)

    return best(0, frozenset())


# ---- random traces (hypothesis) -------------------------------------------------------------------------

@st.composite
def agent_requests(draw, next_id: list[int], depth: int = 0):
    """Prefix-chained requests: each keeps a prefix of the previous context and appends fresh blocks."""
    chain: list[int] = []
    out = []
    for _ in range(draw(st.integers(1, 5))):
        if depth == 0 and out and draw(st.integers(0, 4)) == 0:
            group = [sub(draw(agent_requests(next_id, 1)), t=0.0, duration=0.0)
                     for _ in range(draw(st.integers(1, 2)))]
            out += group
        keep = draw(st.integers(0, len(chain)))
        add = draw(st.integers(0, 4))
        chain = chain[:keep] + list(range(next_id[0], next_id[0] + add))
        next_id[0] += add
        out.append(req(chain, think=draw(st.sampled_from([0.0, 1.0, 7.0])), out=draw(st.integers(1, 50)),
                       extra_tokens=draw(st.integers(0, BT - 1))))
    return out


@st.composite
def workloads(draw):
    return [trace(f"t{i}", draw(agent_requests([1]))) for i in range(draw(st.integers(1, 3)))]
