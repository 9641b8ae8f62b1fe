"""``kvtier bench hybrid-bytes``: bytes stored per prompt token for hybrid models, kvtier's per-group objects
beside storing every group whole, one packed object per block, and the engine's own ``reachable_block_mask``.

No bytes move: this counts what each scheme would store for the same agentic requests (sessions of several
agents sharing a system prompt, sub-agents forking at a shared task, every turn's prompt extending the last
one), with the decisions the connector itself makes (kvtier.connectors.vllm.groups: ``hit_boundaries``,
``save_mask``; vLLM's ``SlidingWindowManager`` / ``MambaManager.reachable_block_mask``). A block is counted once
per (group, prefix): a prefix two requests share is stored once, as the store would.

Schemes (bytes per prompt token; the figure is kvtier's, the baseline is "whole"):

* ``whole``: every full prompt block of every group (what a connector that knows no groups would store).
* ``packed``: one object per block holding every group, at each block where any group has something worth
  storing (DeepSeek V4's packed layout, trimmed to reachable blocks): the granularity question.
* ``engine``: vLLM's own retention (``reachable_block_mask`` with the engine's alignment and retention 0; full
  attention: every block).
* ``kvtier``: one object per group per block; sliding-window blocks inside the window of a hit point, recurrent
  state at hit points, full-attention blocks up to the deepest hit point. Recurrent (Mamba/GDN) groups store
  the checkpoints vLLM hands over (boundary_state_offloads), which are the ones its own mask keeps.

The models are the tiny configs of tests/engine (block sizes and page bytes as the vLLM 0.32 CPU engine plans
them: gemma3 block 32, 16 KiB pages; q3next block 160, 80 KiB pages, its Mamba page padded to the attention one).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.bench.common import write_json


@dataclass(frozen=True)
class Model:
    name: str
    block_size: int
    page_bytes: int  # one group's block (vLLM pads every group to one page size)
    kinds: tuple[str, ...]  # per group: "full", "sliding_window" or "mamba"
    window: int = 0


MODELS = {
    "gemma3-tiny": Model("gemma3-tiny", 32, 16384, ("sliding_window",) * 3 + ("full",), window=128),
    "q3next-tiny": Model("q3next-tiny", 160, 81920, ("mamba",) * 3 + ("full",)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--agents", type=int, default=4, help="agents per session (one parent, the rest sub-agents)")
    p.add_argument("--turns", type=int, default=6, help="turns per agent")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=2000, help="system prompt every agent shares")
    p.add_argument("--task-tokens", type=int, default=600, help="task the sub-agents fork from")
    p.add_argument("--turn-tokens", type=int, default=400, help="mean output + tool result added per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")


@dataclass
class Request:
    tokens: list[int]
    junction: int  # shared_prefix_boundary: the prefix a second request was seen sharing (0: none)


def workload(args: argparse.Namespace) -> list[Request]:
    """Agentic sessions: sub-agents fork from (system, task); every turn's prompt extends the agent's last."""
    rng = random.Random(args.seed)
    fresh = iter(range(10_000, 1 << 30))
    system = [next(fresh) for _ in range(args.system_tokens)]
    out: list[Request] = []
    seen: list[list[int]] = []

    def junction(tokens: list[int]) -> int:
        best = 0
        for other in seen:
            n = 0
            for a, b in zip(tokens, other):
                if a != b:
                    break
                n += 1
            best = max(best, n if n < len(tokens) else 0)
        return best

    for _ in range(args.sessions):
        task = [next(fresh) for _ in range(args.task_tokens)]
        prompts = [system + task + [next(fresh) for _ in range(rng.randint(50, 300))] for _ in range(args.agents)]
        for _turn in range(args.turns):
            for a in range(args.agents):
                out.append(Request(list(prompts[a]), junction(prompts[a])))
                seen.append(prompts[a])
                prompts[a] = prompts[a] + [next(fresh) for _ in range(rng.randint(args.turn_tokens // 2,
                                                                                   args.turn_tokens * 3 // 2))]
    return out


def _spec(model: Model, kind: str) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    kw: dict[str, Any] = dict(block_size=model.block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    if kind == "sliding_window":
        return SlidingWindowSpec(sliding_window=model.window, **kw)
    if kind == "mamba":
        return MambaSpec(block_size=model.block_size, shapes=((4,),), dtypes=(torch.bfloat16,),
                         mamba_cache_mode="align")
    return FullAttentionSpec(**kw)


def measure(model: Model, requests: list[Request]) -> dict[str, Any]:
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SlidingWindowManager

    from kvtier.connectors.vllm.groups import FULL, SLIDING_WINDOW, GroupSpec, hit_boundaries, save_mask

    bs = model.block_size
    specs = [_spec(model, k) for k in model.kinds]
    groups = [GroupSpec(i, SLIDING_WINDOW if k == "sliding_window" else FULL, bs, (), window=model.window
                        if k == "sliding_window" else 0, spec=s) for i, (k, s) in enumerate(zip(model.kinds, specs))]
    stored: dict[str, set[tuple[int, tuple[int, ...]]]] = {"whole": set(), "packed": set(), "engine": set(),
                                                           "kvtier": set()}
    prompt_tokens = 0
    for req in requests:
        n = len(req.tokens)
        prompt_tokens += n
        blocks = (n - 1) // bs  # full blocks before the prompt's last token (which the engine always computes)
        prefix = [tuple(req.tokens[: (i + 1) * bs]) for i in range(blocks)]
        points = hit_boundaries(n, req.junction, n, bs, 0)
        any_group = [False] * blocks
        for g, (kind, spec) in enumerate(zip(model.kinds, specs)):
            if kind == "mamba":
                engine = MambaManager.reachable_block_mask(0, blocks, bs, spec, False, 0, points)
                ours = list(engine) if engine is not None else [True] * blocks
            elif kind == "sliding_window":
                engine = SlidingWindowManager.reachable_block_mask(0, blocks, bs, spec, False, 0, points)
                ours = save_mask(groups[g], 0, blocks, points, hybrid=True)
            else:
                engine = None
                ours = save_mask(groups[g], 0, blocks, points, hybrid=True)
            for i in range(blocks):
                stored["whole"].add((g, prefix[i]))
                if engine is None or engine[i]:
                    stored["engine"].add((g, prefix[i]))
                if ours[i]:
                    stored["kvtier"].add((g, prefix[i]))
                    any_group[i] = True
        for i in range(blocks):
            if any_group[i]:
                for g in range(len(model.kinds)):
                    stored["packed"].add((g, prefix[i]))
    per_token = {k: len(v) * model.page_bytes / prompt_tokens for k, v in stored.items()}
    return {"model": model.name, "requests": len(requests), "prompt_tokens": prompt_tokens,
            **{f"{k}_bytes_per_token": round(v, 1) for k, v in per_token.items()},
            "ratio_vs_whole": round(per_token["kvtier"] / per_token["whole"], 4),
            "ratio_vs_packed": round(per_token["kvtier"] / per_token["packed"], 4),
            "ratio_vs_engine": round(per_token["kvtier"] / per_token["engine"], 4)}


def run(args: argparse.Namespace) -> int:
    requests = workload(args)
    rows = [measure(MODELS[name], requests) for name in args.models.split(",")]
    print(f"\nbytes stored per prompt token, {len(requests)} agentic requests ({args.sessions} sessions x "
          f"{args.agents} agents x {args.turns} turns); figure: kvtier (one object per group per block, reachable "
          "blocks only); baselines: every group whole, one packed object per reachable block, vLLM's own retention")
    print(f"{'model':>14}{'kvtier B/tok':>14}{'whole B/tok':>13}{'ratio':>8}{'packed B/tok':>14}{'ratio':>8}"
          f"{'engine B/tok':>14}{'ratio':>8}")
    for r in rows:
        print(f"{r['model']:>14}{r['kvtier_bytes_per_token']:>14.1f}{r['whole_bytes_per_token']:>13.1f}"
              f"{r['ratio_vs_whole']:>8.3f}{r['packed_bytes_per_token']:>14.1f}{r['ratio_vs_packed']:>8.3f}"
              f"{r['engine_bytes_per_token']:>14.1f}{r['ratio_vs_engine']:>8.3f}")
    write_json(rows, args.json)
    return 0
