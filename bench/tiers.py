"""``kvtier bench tiers``: batch put/get throughput of a tier beside a physical baseline of the same bytes.

DRAM: the store's batched put and get into caller-owned buffers, against the best copy of the same bytes this
host does in the same rounds (np.copyto, np.copyto on two threads, kvtier's copy_rows on one and two threads:
bench/copies.py). Rounds interleave baseline, put and get so machine noise hits all alike; the figures are
medians over rounds, after one warm-up round that faults every page in.
SSD: bench/ssd.py, against raw O_DIRECT I/O of the same bytes. Pool: bench/pool.py, against a raw TCP socket
between two processes and memcpy. Then the lookup rows of the paths of that tier (bench/lookup.py: 2,000 present
keys in process beside the DRAM rows; over the pool's shm and TCP, and the master's, beside the pool rows).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from kvtier.bench.common import gbps, median, print_rows, row, time_once, write_json
from kvtier.bench.copies import HostCopies
from kvtier.bench.lookup import PATHS as LOOKUP_PATHS
from kvtier.bench.lookup import bench_lookups, print_lookups
from kvtier.bench.pool import bench_pool
from kvtier.bench.ssd import DEFAULT_SIZES as SSD_SIZES
from kvtier.bench.ssd import bench_ssd
from kvtier.keys import Namespace
from kvtier.store import TieredStore
from kvtier.units import parse_bytes

DEFAULT_SIZES = "64KiB,1MiB,4MiB"


def bench_dram(sizes: list[int], total: int, rounds: int, copy_threads: int | None = None, **_: Any
               ) -> list[dict[str, Any]]:
    rows = []
    ns = Namespace("bench-dram")
    for bb in sizes:
        n = max(1, total // bb)
        nbytes = n * bb
        src = torch.arange(nbytes, dtype=torch.int32).to(torch.uint8).view(n, bb)  # not constant: catches mixups
        out = torch.empty_like(src)
        src_np, out_np = src.numpy(), out.numpy()
        setting = {} if copy_threads is None else {"copy_threads": copy_threads}  # None: the setting's default
        store = TieredStore.from_config({"dram_capacity": nbytes, **setting}, bb)
        copies = HostCopies(src_np, out_np)
        put_t, get_t = [], []
        for r in range(rounds + 1):  # round 0 warms up: page faults in the tier, src and out
            keys = ns.keys(range(r * n, (r + 1) * n))
            copies.round(keep=r > 0)
            p = time_once(lambda: store.put(keys, src))
            out.zero_()
            g = time_once(lambda: store.get(keys, out))
            if not torch.equal(out, src):
                raise RuntimeError(f"dram bench: bytes read back differ from bytes written at {bb} B blocks")
            store.remove(keys)
            if r:
                put_t.append(p), get_t.append(g)
        dram = store.tiers[0]
        pages = dram.buffer.pages()
        threads = "; ".join(f"{op} copies on {c} thread{'s' * (c > 1)} {copies_of.rate(c, nbytes) / 1e9:.2f} GB/s"
                            for op, copies_of in (("put", dram.put_copies), ("get", dram.get_copies))
                            for c in copies_of.choices if copies_of.rate(c, nbytes))
        store.close()
        copies.close()
        best_name, base = copies.best()
        print(f"dram bench {bb >> 10} KiB blocks: baseline {best_name} ({base:.2f} GB/s), the fastest copy of the "
              f"same bytes in the same rounds; the tier's buffer is on {pages} pages"
              + (f"; copy threads by measured rate (medians of the last batches): {threads}" if threads else ""))
        rows += copies.rows({"tier": "dram", "block_bytes": bb})  # each candidate (1 and 2 threads) beside the best
        rows.append(row({"tier": "dram", "path": "store", "op": "put", "block_bytes": bb},
                        gbps(nbytes, median(put_t)), base))
        rows.append(row({"tier": "dram", "path": "store", "op": "get", "block_bytes": bb},
                        gbps(nbytes, median(get_t)), base))
    return rows


# --tier NAME -> (function, baseline description, default sizes). Lower tiers add themselves here; each
# function takes (sizes, total, rounds, **options) and ignores the options meant for other tiers.
TIER_BENCHES: dict[str, tuple[Callable[..., list[dict[str, Any]]], str, str]] = {
    "dram": (bench_dram, "the fastest copy of the same bytes (np.copyto or copy_rows, 1 or 2 threads)",
             DEFAULT_SIZES),
    "ssd": (bench_ssd, "raw O_DIRECT write+fdatasync / read of the same bytes", SSD_SIZES),
    "pool": (bench_pool, "tcp rows: one raw TCP socket between two processes; shm and copy rows: the "
                         "fastest copy (np.copyto or copy_rows, 1 or 2 threads); same bytes, same run",
             DEFAULT_SIZES),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", choices=sorted(TIER_BENCHES), default="dram", help="which tier to measure")
    p.add_argument("--sizes", help=f"block sizes, comma-separated (default {DEFAULT_SIZES}; ssd: {SSD_SIZES})")
    p.add_argument("--total", default="1GiB", help="bytes moved per size and round (default 1GiB)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per size; medians are reported")
    p.add_argument("--copy-threads", type=int, help="dram: threads per batched host copy (default: the copy_threads setting's, 0 = by measured rate)")
    p.add_argument("--path", help="ssd: a directory on the disk to measure (default /var/tmp)")
    p.add_argument("--connections", type=int, default=4, help="pool: parallel TCP connections per batch")
    p.add_argument("--no-mooncake", dest="mooncake", action="store_false",
                   help="pool: skip the Mooncake Store rows even where it is installed")
    p.add_argument("--pool-auth", action="store_true", help="pool: also measure a pool started with --auth-dir "
                   "(CurveZMQ control and tcp frames, tokens on the data port): paths *+auth")
    p.add_argument("--no-lookups", dest="lookups", action="store_false",
                   help="skip the lookup rows (2,000 present keys: dram in process; pool over shm and tcp, master)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    # One torch thread, as the project's benches pin it: after a torch op on two threads (the rounds zero the
    # output tensor) its idle OpenMP worker spins for a while and takes a core from the copy being timed: a
    # two-thread copy_rows right after such a zero_() ran at 16.5 GB/s, after a one-thread one at 19.8 (so a
    # DRAM get measured 0.71-0.79 of the best copy, and the baseline copies, which zero no tensor, did not pay it).
    torch.set_num_threads(1)
    fn, baseline, default_sizes = TIER_BENCHES[args.tier]
    sizes = [parse_bytes(s) for s in (args.sizes or default_sizes).split(",") if s.strip()]
    rows = fn(sizes, parse_bytes(args.total), args.rounds, copy_threads=args.copy_threads, path=args.path,
              connections=args.connections, mooncake=args.mooncake, pool_auth=args.pool_auth)
    print_rows(rows, f"kvtier bench tiers --tier {args.tier}", baseline)
    lookups = bench_lookups(LOOKUP_PATHS.get(args.tier, ()), args.rounds) if args.lookups else []
    print_lookups(lookups)
    write_json(rows + lookups, args.json)
    return 0
