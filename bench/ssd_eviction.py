"""Why the SSD tier evicts per block: a key-level simulation of its eviction choices on the agentic-cc traces.

``python -m kvtier.bench.ssd_eviction [--traces 120 --lanes 64 --ssd 0.05,0.1,0.2]`` replays conversations
(lanes play one conversation each, requests ordered by think and API time, subagents inline) through an LRU
DRAM tier of 10% of the working set with an SSD tier under it (on_evict offload, promotion on hit), and prints,
per SSD size and eviction scheme, the share of block reads served by each tier and the SSD writes per block
offered by DRAM: the write amplification a log-structured design pays for reinsertion.

Schemes: per-block slots with a policy from kvtier.policies (what DiskTier does), and segment FIFO (CacheLib
Navy-style regions of ``--segment`` blocks reclaimed oldest first) with and without reinsertion of blocks hit
since they were written. A study, not a speed benchmark: no bytes move. Its trace reading is deliberately
small; the replay tool (issue 3) is the general one.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import random
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.policies import make_policy

TRACES = Path("/work/shared/traces/agentic-cc")


def _flatten(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in requests:
        out += _flatten(r["requests"]) if r.get("type") == "subagent" else [r]
    return out


def requests(files: list[Path], lanes: int) -> Iterator[list[int]]:
    """Block ids of each request, conversations interleaved by lane; ids made unique per trace."""
    convs = []
    for n, f in enumerate(files):
        reqs = _flatten(json.load(gzip.open(f))["requests"])
        convs.append([([(n << 32) | h for h in r["hash_ids"]], r.get("api_time", 1.0) + min(r.get("think_time", 0.0),
                                                                                            60.0)) for r in reqs])
    todo = list(range(len(convs)))[::-1]
    heap = [(0.0, lane, todo.pop(), 0) for lane in range(min(lanes, len(todo)))]
    heapq.heapify(heap)
    while heap:
        t, lane, c, i = heapq.heappop(heap)
        ids, delay = convs[c][i]
        yield ids
        if i + 1 < len(convs[c]):
            heapq.heappush(heap, (t + delay, lane, c, i + 1))
        elif todo:
            heapq.heappush(heap, (t + delay, lane, todo.pop(), 0))


class PerBlock:
    """Fixed-size slots, one block each, freed and reused per block (DiskTier's scheme)."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.capacity, self.policy, self.held, self.writes = capacity, make_policy(policy, capacity), set(), 0

    def holds(self, k: int) -> bool:
        return k in self.held

    def hit(self, k: int) -> bool:
        if k in self.held:
            self.policy.access([k])
            return True
        return False

    def write(self, k: int) -> None:
        self.writes += 1
        if len(self.held) >= self.capacity:
            self.held.difference_update(self.policy.victims(1, ()))
        self.policy.insert([k])
        self.held.add(k)


class SegmentFIFO:
    """Append-only segments of ``segment`` blocks, the oldest reclaimed whole; with ``reinsert``, blocks hit
    since they were written are appended again instead of dropped (each such copy is one more write)."""

    def __init__(self, capacity: int, segment: int, reinsert: bool) -> None:
        self.max_segments, self.segment, self.reinsert = max(2, capacity // segment), segment, reinsert
        self.segments: list[list[int]] = [[]]
        self.where: dict[int, list[int]] = {}
        self.was_hit: set[int] = set()
        self.writes = 0

    def holds(self, k: int) -> bool:
        return k in self.where

    def hit(self, k: int) -> bool:
        if k in self.where:
            self.was_hit.add(k)
            return True
        return False

    def write(self, k: int) -> None:
        if len(self.segments[-1]) >= self.segment:
            self.segments.append([])
            if len(self.segments) > self.max_segments:
                for x in self.segments.pop(0):
                    if self.where.get(x) is not None:
                        del self.where[x]
                        if self.reinsert and x in self.was_hit:
                            self.was_hit.discard(x)
                            self.write(x)
                        self.was_hit.discard(x)
        self.segments[-1].append(k)
        self.where[k] = self.segments[-1]
        self.writes += 1


def simulate(files: list[Path], lanes: int, dram: int, ssd: Any) -> dict[str, float]:
    dram_lru: OrderedDict[int, None] = OrderedDict()
    served = {"dram": 0, "ssd": 0, "miss": 0}
    offered = 0
    for ids in requests(files, lanes):
        for k in ids:
            if k in dram_lru:
                dram_lru.move_to_end(k)
                served["dram"] += 1
                continue
            served["ssd" if ssd.hit(k) else "miss"] += 1
            dram_lru[k] = None  # recomputed, or promoted from SSD
            if len(dram_lru) > dram:
                victim, _ = dram_lru.popitem(last=False)
                if not ssd.holds(victim):
                    offered += 1
                    ssd.write(victim)
    total = sum(served.values())
    return {"dram_hit": served["dram"] / total, "ssd_hit": served["ssd"] / total,
            "total_hit": (served["dram"] + served["ssd"]) / total, "ssd_writes": ssd.writes,
            "writes_per_offered": ssd.writes / max(offered, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=int, default=60, help="conversations (a fixed random sample)")
    p.add_argument("--lanes", type=int, default=32, help="conversations in flight at once")
    p.add_argument("--ssd", default="0.05,0.1,0.2", help="SSD sizes as fractions of the working set")
    p.add_argument("--segment", type=int, default=64, help="blocks per segment for the segment schemes")
    p.add_argument("--schemes", default="block-lru,block-fifo,block-s3fifo,segment-fifo,segment-fifo+reinsert")
    args = p.parse_args(argv)
    files = sorted(TRACES.glob("*.json.gz"))
    random.Random(0).shuffle(files)
    files = files[: args.traces]
    working_set = len({k for ids in requests(files, args.lanes) for k in ids})
    dram = working_set // 10
    print(f"{len(files)} conversations, {args.lanes} lanes, working set {working_set} blocks, DRAM LRU {dram}")
    for frac in (float(x) for x in args.ssd.split(",")):
        cap = int(working_set * frac)
        for scheme in args.schemes.split(","):
            if scheme.startswith("block-"):
                ssd: Any = PerBlock(cap, scheme.removeprefix("block-"))
            else:
                ssd = SegmentFIFO(cap, args.segment, reinsert=scheme.endswith("+reinsert"))
            r = simulate(files, args.lanes, dram, ssd)
            print(f"ssd {frac:>4.0%} of WS  {scheme:<24} dram {r['dram_hit']:.3f}  ssd {r['ssd_hit']:.3f}  "
                  f"total {r['total_hit']:.3f}  ssd writes {r['ssd_writes']:>9}  "
                  f"per offered {r['writes_per_offered']:.2f}", flush=True)


if __name__ == "__main__":
    main()
