"""``kvtier bench policies``: what a policy costs per key, beside LRU's cost in the same run.

A synthetic agentic loop through a full tier, as the replay drives one: ``agents`` agents take turns; each turn
observes the agent's arrival (its whole chain, root first, resolved by a SessionTracker: inferred sessions),
hits the chain's longest held prefix (``access``), stores the rest (``victims`` to make room, then
``insert``; what ``admit`` declines is not stored) and observes the completion. Each turn appends ``batch``
new keys to the agent's chain, up to ``chain`` keys, then the agent starts over as a new session. Every policy
runs the same turns; reported: CPU time per key of each call (observe: per key of the arrival's chain, with the
completion; access: per hit key; victims, with admit: per key of the put's batch or per victim, whichever is
more; insert: per inserted key), the total per key over all calls beside LRU's (the target: at most 3x), and
the time per turn, medians over ``rounds``.
Keys-only policies are not called for observations (a store forwards them none).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from kvtier.bench.common import median, write_json
from kvtier.policies import Arrival, Completion, Observations, make_policy, resolve_name
from kvtier.policies.sessions import SessionTracker

DEFAULT_POLICIES = "lru,default,chain-lru,s3fifo,arc,fifo"


def _workload(batch: int, agents: int, chain: int, turns: int) -> list[tuple[str, list[bytes]]]:
    """(request id, chain root first) per turn; the last ``batch`` keys of each chain are new."""
    chains: list[list[bytes]] = [[] for _ in range(agents)]
    serial = 0
    out = []
    for t in range(turns):
        a = t % agents
        if len(chains[a]) + batch > chain:
            chains[a] = []  # a new agent in that lane
        for _ in range(batch):
            serial += 1
            chains[a].append(serial.to_bytes(16, "little"))
        out.append((str(t), list(chains[a])))
    return out


def bench_policy(name: str, work: list[tuple[str, list[bytes]]], capacity: int, warm: int) -> dict[str, float]:
    now = [0.0]
    policy = make_policy(name, capacity, clock=lambda: now[0])  # a virtual clock: a turn takes 1.5 s
    tracker = SessionTracker(lambda: now[0])
    held: set[bytes] = set()
    spent = {"observe": 0.0, "access": 0.0, "insert": 0.0, "victims": 0.0}
    keys_in = {"observe": 0, "access": 0, "insert": 0, "victims": 0}
    turns = 0
    cpu = time.process_time  # CPU time: other processes on a shared machine do not count
    gc.disable()  # the collector's pauses would land on whichever call triggers them
    try:
        for i, (rid, keys) in enumerate(work):
            timed = i >= warm
            now[0] += 1.0
            t0 = cpu()
            if policy.observes:
                policy.observe(tracker.resolve(Observations(arrivals=[Arrival(rid, keys)])))
            t1 = cpu()
            hit = next((j for j, k in enumerate(keys) if k not in held), len(keys))
            policy.access(keys[:hit][::-1])
            t2 = cpu()
            new = [k for k in keys[hit:] if k not in held]
            batch = new[::-1] if i % 2 else new  # tail first (the replay) or root first (vLLM)
            free = capacity - len(held)
            order = policy.admit(batch, free) if len(batch) > free else None
            take = [batch[j] for j in order] if order is not None else batch
            gone = policy.victims(max(0, len(take) - free), ())
            t3 = cpu()
            take = take[: free + len(gone)]
            policy.insert(take)
            t4 = cpu()
            held.difference_update(gone)
            held.update(take)
            now[0] += 0.5
            t5 = cpu()
            if policy.observes:
                policy.observe(tracker.resolve(Observations(completions=[Completion(rid, stop="tool_use")])))
            t6 = cpu()
            if timed:
                turns += 1
                for name, dt, n in (("observe", (t1 - t0) + (t6 - t5), len(keys) if policy.observes else 0),
                                    ("access", t2 - t1, hit), ("victims", t3 - t2, max(len(gone), len(batch))),
                                    ("insert", t4 - t3, len(take))):
                    spent[name] += dt
                    keys_in[name] += n
    finally:
        gc.enable()
    out = {f"{k}_ns": spent[k] / keys_in[k] * 1e9 if keys_in[k] else 0.0 for k in spent}
    out["total_ns"] = sum(spent.values()) / max(1, sum(keys_in.values())) * 1e9
    out["turn_us"] = sum(spent.values()) / max(1, turns) * 1e6
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    p.add_argument("--batch", type=int, default=2000, help="new keys per turn (default 2000)")
    p.add_argument("--capacity", type=int, default=200_000, help="keys the tier holds (default 200000)")
    p.add_argument("--agents", type=int, default=32, help="agents taking turns (default 32)")
    p.add_argument("--chain", type=int, default=16_000, help="keys in an agent's chain before it starts over")
    p.add_argument("--turns", type=int, default=400, help="turns per round, after warm-up (default 400)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported (default 3)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    names = [x.strip() for x in args.policies.split(",") if x.strip()]
    if "lru" not in names:
        names.insert(0, "lru")  # the baseline
    warm = max(1, 2 * args.capacity // args.batch)  # fill the tier first: every timed turn evicts
    work = _workload(args.batch, args.agents, args.chain, warm + args.turns)
    per: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(args.rounds):  # interleaved, so machine noise hits every policy alike
        for name in names:
            per[name].append(bench_policy(name, work, args.capacity, warm))
    cols = ("observe_ns", "access_ns", "insert_ns", "victims_ns", "total_ns", "turn_us")
    rows: list[dict[str, Any]] = []
    lru_total = median([r["total_ns"] for r in per["lru"]])
    for name in names:
        r = {c: round(median([x[c] for x in per[name]]), 1) for c in cols}
        rows.append({"policy": name, "resolves_to": resolve_name(name), **r, "lru_total_ns": round(lru_total, 1),
                     "ratio_to_lru": round(r["total_ns"] / lru_total, 2) if lru_total else None})
    print(f"\npolicy cost per key of each call (turns of {args.batch:,} new keys on chains up to {args.chain:,}, "
          f"tier of {args.capacity:,} keys, {args.agents} agents; CPU ns, medians of {args.rounds} rounds of "
          f"{args.turns} turns; baseline: LRU in the same run)")
    print(f"{'policy':<12}{'observe':>9}{'access':>9}{'insert':>9}{'victims':>9}{'total':>9}{'LRU':>9}{'ratio':>7}"
          f"{'us/turn':>10}")
    for r in rows:
        print(f"{r['policy']:<12}{r['observe_ns']:>9.0f}{r['access_ns']:>9.0f}{r['insert_ns']:>9.0f}"
              f"{r['victims_ns']:>9.0f}{r['total_ns']:>9.0f}{r['lru_total_ns']:>9.0f}{r['ratio_to_lru']:>7.2f}"
              f"{r['turn_us']:>10.0f}")
    write_json(rows, args.json)
    return 0
