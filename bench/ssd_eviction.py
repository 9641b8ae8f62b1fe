"""Why the SSD tier evicts per block: a key-level simulation of its eviction choices on the agentic-cc traces.

``kvtier bench ssd-eviction --traces kvtier/sample-traces/agentic-cc [--conversations 120 --lanes 64
--ssd 0.05,0.1,0.2]`` replays conversations (lanes play one conversation each, requests ordered by their
think time plus a nominal second of API time, subagents inline) through an LRU DRAM tier of 10% of the
working set with an SSD tier under it (on_evict offload, promotion on hit), and prints, per SSD size and
eviction scheme, the share of block reads served by each tier and the SSD writes per block offered by DRAM:
the write amplification a log-structured design pays for reinsertion.

Schemes: per-block slots with a policy from kvtier.policies (what DiskTier does), and segment FIFO (CacheLib
Navy-style regions of ``--segment`` blocks reclaimed oldest first) with and without reinsertion of blocks hit
since they were written. A study, not a speed benchmark: no bytes move. Traces are read by kvtier.tools.replay's
reader (agentic-cc format; the replay tool is the general simulator).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvtier.policies import make_policy
from kvtier.tools.replay.traces import TraceError, expand_paths, inline, read_trace

API_TIME_S = 1.0  # a request's service time in the lane schedule (the parsed trace keeps think times only)
MAX_THINK_S = 60.0  # longer pauses only reorder lanes; capped as in the first study
Conversation = list[tuple[np.ndarray, float]]  # (block ids, delay before the request) per request


def load_conversations(paths: Sequence[str], count: int) -> list[Conversation]:
    """A fixed random sample of ``count`` agentic-cc traces from ``paths`` (files or directories); block
    ids are made unique per trace."""
    files = expand_paths(paths)
    random.Random(0).shuffle(files)
    convs = []
    for n, f in enumerate(files[:count]):
        trace = read_trace(f)
        if trace.timed:
            raise TraceError(f"{f}: a timed (Mooncake) trace; this study replays agentic-cc conversations")
        convs.append([((n << 32) | trace.raw_ids[r.blocks], min(r.delay, MAX_THINK_S))
                      for r in inline(trace.steps)])
    return convs


def requests(convs: list[Conversation], lanes: int) -> Iterator[np.ndarray]:
    """Block ids of each request, conversations interleaved by lane."""
    todo = list(range(len(convs)))[::-1]
    heap = [(0.0, lane, todo.pop(), 0) for lane in range(min(lanes, len(todo)))]
    heapq.heapify(heap)
    while heap:
        t, lane, c, i = heapq.heappop(heap)
        yield convs[c][i][0]
        if i + 1 < len(convs[c]):
            heapq.heappush(heap, (t + API_TIME_S + convs[c][i + 1][1], lane, c, i + 1))
        elif todo:
            heapq.heappush(heap, (t + API_TIME_S, lane, todo.pop(), 0))


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


def simulate(convs: list[Conversation], lanes: int, dram: int, ssd: Any) -> dict[str, float]:
    dram_lru: OrderedDict[int, None] = OrderedDict()
    served = {"dram": 0, "ssd": 0, "miss": 0}
    offered = 0
    for ids in requests(convs, lanes):
        for k in ids.tolist():
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
    total = max(sum(served.values()), 1)
    return {"dram_hit": served["dram"] / total, "ssd_hit": served["ssd"] / total,
            "total_hit": (served["dram"] + served["ssd"]) / total, "ssd_writes": ssd.writes,
            "writes_per_offered": ssd.writes / max(offered, 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", nargs="+", required=True, metavar="PATH",
                   help="agentic-cc trace files or directories (e.g. kvtier/sample-traces/agentic-cc, the shipped "
                        "sample)")
    p.add_argument("--conversations", type=int, default=60, help="conversations (a fixed random sample)")
    p.add_argument("--lanes", type=int, default=32, help="conversations in flight at once")
    p.add_argument("--ssd", default="0.05,0.1,0.2", help="SSD sizes as fractions of the working set")
    p.add_argument("--segment", type=int, default=64, help="blocks per segment for the segment schemes")
    p.add_argument("--schemes", default="block-lru,block-fifo,block-s3fifo,segment-fifo,segment-fifo+reinsert")


def run(args: argparse.Namespace) -> int:
    convs = load_conversations(args.traces, args.conversations)
    working_set = len({k for ids in requests(convs, args.lanes) for k in ids.tolist()})
    if not working_set:
        raise TraceError(f"{', '.join(args.traces)}: the traces hold no full blocks")
    dram = max(1, working_set // 10)
    print(f"{len(convs)} conversations, {args.lanes} lanes, working set {working_set} blocks, DRAM LRU {dram}")
    for frac in (float(x) for x in args.ssd.split(",")):
        cap = max(1, int(working_set * frac))
        for scheme in args.schemes.split(","):
            if scheme.startswith("block-"):
                ssd: Any = PerBlock(cap, scheme.removeprefix("block-"))
            else:
                ssd = SegmentFIFO(cap, args.segment, reinsert=scheme.endswith("+reinsert"))
            r = simulate(convs, args.lanes, dram, ssd)
            print(f"ssd {frac:>4.0%} of WS  {scheme:<24} dram {r['dram_hit']:.3f}  ssd {r['ssd_hit']:.3f}  "
                  f"total {r['total_hit']:.3f}  ssd writes {r['ssd_writes']:>9}  "
                  f"per offered {r['writes_per_offered']:.2f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.ssd_eviction", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except (TraceError, ValueError) as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
