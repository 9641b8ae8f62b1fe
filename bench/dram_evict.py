"""``kvtier bench dram-evict``: what DRAM evictions cost a put, and what they cost other DRAM calls meanwhile.

1. Evicting puts: a full DRAM tier of ``--slots`` blocks takes batches of ``--batch`` new keys (each evicts as many),
   GB/s of the put beside ``np.copyto`` of the same bytes in the same run, medians of ``--rounds`` puts.
2. DRAM get latency while another thread's puts evict into an SSD tier without staging (``ssd_staging_bytes=0``:
   each eviction writes the disk synchronously, handed down with DRAM's lock released): p50 and p99 of gets of
   one pinned resident block, beside the same gets with no writer in the same run, and the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

from kvtier import Namespace, TieredStore
from kvtier.bench.common import gbps, median, print_rows, row, write_json
from kvtier.units import parse_bytes


def evicting_puts(bb: int, slots: int, batch: int, rounds: int) -> dict[str, Any]:
    ns = Namespace(f"bench-evict-{bb}")
    store = TieredStore.from_config({"dram_capacity": slots * bb, "eviction": "lru"}, bb)
    src = torch.randint(0, 255, (batch, bb), dtype=torch.uint8)
    dst = torch.empty_like(src)
    put_t, base_t = [], []
    warm = slots // batch + 2  # fill the tier first: every timed put evicts
    for r in range(rounds + warm):
        keys = ns.keys(range(r * batch, (r + 1) * batch))
        t = time.perf_counter()
        np.copyto(dst.numpy(), src.numpy())
        b = time.perf_counter() - t
        t = time.perf_counter()
        store.put(keys, src)
        p = time.perf_counter() - t
        if r >= warm:
            put_t.append(p), base_t.append(b)
    store.close()
    n = batch * bb
    return row({"op": "evicting put", "block_bytes": bb, "batch": batch}, gbps(n, median(put_t)), gbps(n, median(base_t)))


def gets_under_evictions(bb: int, path: str, seconds: float) -> dict[str, Any]:
    ns = Namespace("bench-evict-getlat")
    with tempfile.TemporaryDirectory(dir=path) as d:
        store = TieredStore.from_config({"dram_capacity": 64 * bb, "ssd_path": d, "ssd_capacity": 4096 * bb,
                                         "ssd_staging_bytes": 0, "ssd_promote": False}, bb)
        hot = ns.keys([1 << 40])
        store.put(hot, torch.ones(1, bb, dtype=torch.uint8))
        store.pin(hot)
        out = torch.empty(1, bb, dtype=torch.uint8)

        def gets(span: float) -> list[float]:
            lat, end = [], time.perf_counter() + span
            while time.perf_counter() < end:
                t = time.perf_counter()
                store.get(hot, out)
                lat.append(time.perf_counter() - t)
                time.sleep(0.0005)
            return lat

        alone = gets(seconds / 2)
        stop = threading.Event()

        def writer() -> None:
            src = torch.randint(0, 255, (8, bb), dtype=torch.uint8)
            i = 0
            while not stop.is_set():
                store.put(ns.keys(range(i, i + 8)), src)
                i += 8

        w = threading.Thread(target=writer, name="bench-evicting-writer")
        w.start()
        time.sleep(0.3)
        busy = gets(seconds)
        stop.set()
        w.join()
        evictions = store.stats()["tiers"]["dram"]["evictions"]
        store.close(timeout_s=1)

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))] * 1e6

    return {"op": "dram get under evicting puts (ssd staging 0)", "block_bytes": bb, "evictions": evictions,
            "p50_us": round(q(busy, 0.5), 1), "p99_us": round(q(busy, 0.99), 1),
            "baseline_p50_us": round(q(alone, 0.5), 1), "baseline_p99_us": round(q(alone, 0.99), 1),
            "p99_ratio": round(q(busy, 0.99) / q(alone, 0.99), 2)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB", help="block sizes of the evicting puts")
    p.add_argument("--slots", type=int, default=256, help="DRAM slots of the evicting-put tier")
    p.add_argument("--batch", type=int, default=32, help="new keys per put (each evicts as many)")
    p.add_argument("--rounds", type=int, default=400, help="timed puts per size; medians are reported")
    p.add_argument("--path", default="/var/tmp", help="a directory on the disk the SSD tier of part 2 uses")
    p.add_argument("--seconds", type=float, default=3.0, help="part 2: how long the gets run beside the writer")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rows = [evicting_puts(parse_bytes(s), args.slots, args.batch, args.rounds) for s in args.sizes.split(",")]
    print_rows(rows, "kvtier bench dram-evict", "np.copyto of the same bytes")
    lat = gets_under_evictions(64 << 10, args.path, args.seconds)
    print(f"\n{lat['op']}, 64 KiB: p50 {lat['p50_us']:.0f} us, p99 {lat['p99_us']:.0f} us; baseline (no writer) "
          f"p50 {lat['baseline_p50_us']:.0f} us, p99 {lat['baseline_p99_us']:.0f} us; p99 ratio {lat['p99_ratio']:.1f} "
          f"({lat['evictions']} evictions)")
    write_json({"puts": rows, "gets": lat}, args.json)
    return 0
