"""``kvtier bench master``: lookup and cost latency of a real kvtier-master, beside a raw zmq echo of the same
bytes, and master memory per directory entry.

* A kvtier-master subprocess gets a directory of ``--keys`` keys (2,000-block prompts) over ``--nodes`` nodes
  through the real node protocol (register + inventory).
* Lookups: 1, 4 and 16 client processes (real processes, MasterClient) each send 2,000-key lookups (a 128K-token
  prompt at 64-token blocks) of random prompts for ``--seconds``; keys/s aggregate, p50/p99 per lookup.
  Baseline, measured in the same round by the same processes: a zmq echo server (a plain REQ/REP-style loop,
  no decoding) answering the same 32 KB frame; ratio = master / echo.
* Cost: one client, 2,000 keys x 16 candidate workers; baseline the echo round trip.
* Memory: a Directory of 1M and 10M keys (each held by one or two of 8 nodes) built in a fresh process; bytes
  per entry = RSS growth / keys (also the arrays' own size). Baseline: the 24 B of payload per entry (16 B key
  + one 8 B placement word).

Rounds interleave master and echo so machine noise hits both; figures are medians over rounds. On a shared
2-core machine, client processes compete with the master for the CPUs: read the ratios, not just the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import median, write_json

PROMPT_BLOCKS = 2000


# ---- processes ---------------------------------------------------------------------------------------------

def _echo_server(endpoint_q: Any, stop: Any, bind: str = "tcp://127.0.0.1") -> None:
    """Echo every request back (the raw zmq round trip a lookup is measured beside) at ``bind``: a TCP host (a
    port is chosen) or a full ipc endpoint; the bound endpoint goes to ``endpoint_q``."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if bind.startswith("ipc://"):
        sock.bind(bind)
        endpoint_q.put(bind)
    else:
        endpoint_q.put(f"{bind}:{sock.bind_to_random_port(bind)}")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                sock.send_multipart(frames)
    sock.close(0)
    ctx.term()


def _client(endpoint: str, prompts: list[bytes], seconds: float, raw: bool, ready: Any, go: Any, out: Any,
            seed: int, cost_candidates: list[str] | None) -> None:
    """One client process: lookups (or cost queries, or raw echoes) of random prompts until time is up."""
    import zmq

    from kvtier import wire
    from kvtier.auth import secure_client
    from kvtier.client import MasterClient

    rng = np.random.default_rng(seed)
    lat: list[float] = []
    if raw:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        secure_client(sock, endpoint, None)  # the owner token of a keyless master of this user
        sock.connect(endpoint)
        frames = [wire.encode_request(1, wire.LOOKUP, {"keys": p}) for p in prompts]

        def once(i: int) -> None:
            sock.send(frames[i])
            sock.recv()
    else:
        client = MasterClient(endpoint, timeout_s=30.0)
        if cost_candidates:
            def once(i: int) -> None:
                client.cost(prompts[i], cost_candidates, block_tokens=64, prefill_tokens_per_s=20_000.0)
        else:
            def once(i: int) -> None:
                client.lookup(prompts[i])
    once(0)  # connected and warm before the clock starts
    ready.put(1)
    go.wait()
    t_end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        if t0 >= t_end:
            break
        once(int(rng.integers(len(prompts))))
        lat.append(time.perf_counter() - t0)
    out.put(lat)


def _run_clients(ctx: Any, endpoint: str, prompts: list[bytes], n: int, seconds: float, raw: bool,
                 cost_candidates: list[str] | None = None) -> dict[str, float]:
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(endpoint, prompts, seconds, raw, ready, go, out, i, cost_candidates))
             for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    t0 = time.perf_counter()
    go.set()
    lats = [out.get(timeout=seconds + 120) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    flat = np.concatenate([np.asarray(x) for x in lats]) * 1e3
    return {"keys_per_s": len(flat) * PROMPT_BLOCKS / wall, "p50_ms": float(np.percentile(flat, 50)),
            "p99_ms": float(np.percentile(flat, 99)), "requests": int(len(flat))}


# ---- the directory the master serves ------------------------------------------------------------------------

def _populate(endpoint: str, keys: np.ndarray, nodes: int, workers: int) -> None:
    """Register ``workers`` nodes; the first ``nodes`` hold the prompts: prompt p wholly in node p%nodes's
    dram, its first half also in node (p+1)%nodes's ssd."""
    from kvtier.client import MasterClient, api

    prompts = keys.reshape(-1, PROMPT_BLOCKS, 2)
    with MasterClient(endpoint, timeout_s=120.0) as m:
        for w in range(workers):
            node = f"node-{w}"
            reply = m.call(api.register(node, "bench", 0, [("dram", 1 << 40), ("ssd", 1 << 44)]))
            per = reply.max_batch_keys or 65536  # the largest inventory part the master reads
            dram = prompts[w::nodes].reshape(-1, 2) if w < nodes else keys[:0]
            ssd = prompts[(w - 1) % nodes :: nodes, : PROMPT_BLOCKS // 2].reshape(-1, 2) if w < nodes else keys[:0]
            parts = [("dram", dram[i : i + per]) for i in range(0, len(dram), per)]
            parts += [("ssd", ssd[i : i + per]) for i in range(0, len(ssd), per)]
            parts = parts or [("dram", keys[:0])]
            for i, (tier, chunk) in enumerate(parts):
                m.call(api.inventory(node, "bench", 0, i, i == len(parts) - 1, {tier: chunk}, {tier: 2 << 20}))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


# ---- memory per entry ----------------------------------------------------------------------------------------

_MEMORY_SCRIPT = r"""
import json, sys, numpy as np
from kvtier.master.directory import Directory
from kvtier.master.heat import HeatClock
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
n = int(sys.argv[1])
keys = np.random.default_rng(7).integers(0, 2**63, size=(n, 2), dtype=np.uint64)
d = Directory(HeatClock(600.0, 0.0))
d.ensure_locations(16)
before = rss()
step = 1 << 18
for i in range(0, n, step):
    chunk = keys[i:i + step]
    d.add((i // step) % 8, chunk, 2 << 20, 1.0)
    d.add(8 + (i // step) % 8, chunk[: len(chunk) // 2], 2 << 20, 1.0)
after = rss()
print(json.dumps({"keys": len(d), "rss_bytes": after - before, "array_bytes": d.nbytes, "capacity": d.table.capacity}))
"""


def measure_memory(n: int) -> dict[str, Any]:
    # A fresh process per size, and glibc told to give large frees back to the OS (the table's growth frees
    # its old arrays), so RSS growth is the directory and nothing it left behind.
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(n)], capture_output=True, text=True, env=env,
                       timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"memory measurement at {n} keys failed: {r.stderr.strip()[-500:]}")
    m = json.loads(r.stdout)
    return {"keys": m["keys"], "rss_bytes_per_entry": round(m["rss_bytes"] / m["keys"], 1),
            "array_bytes_per_entry": round(m["array_bytes"] / m["keys"], 1), "capacity": m["capacity"],
            "baseline_bytes_per_entry": 24, "ratio": round(m["rss_bytes"] / m["keys"] / 24, 2)}


# ---- the command ---------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", type=int, default=1_000_000, help="directory size (default 1,000,000)")
    p.add_argument("--nodes", type=int, default=8, help="nodes holding the keys (default 8)")
    p.add_argument("--clients", default="1,4,16", help="client process counts (default 1,4,16)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported (default 3)")
    p.add_argument("--candidates", type=int, default=16, help="candidate workers per cost query (default 16)")
    p.add_argument("--memory", default="1000000,10000000",
                   help="directory sizes for bytes/entry (default 1000000,10000000; empty: skip)")
    p.add_argument("--masters", default="", help="also measure N masters sharing one directory in Redis, for each "
                   "N of this list (e.g. 1,2,3), beside the lmdb single master (bench/master_shared.py)")
    p.add_argument("--directory", default="", help="with --masters: redis://HOST:PORT (each setup takes a fresh "
                   "database of it); default: a redis-server the bench starts")
    p.add_argument("--shared-clients", type=int, default=4, help="with --masters: lookup client processes (default 4)")
    p.add_argument("--staleness-samples", type=int, default=200, help="with --masters: writes timed for staleness")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    n_keys = max(PROMPT_BLOCKS, args.keys // PROMPT_BLOCKS * PROMPT_BLOCKS)
    ctx = mp.get_context("spawn")
    keys = np.random.default_rng(1).integers(0, 2**63, size=(n_keys, 2), dtype=np.uint64)
    prompts = [keys[i * PROMPT_BLOCKS : (i + 1) * PROMPT_BLOCKS].tobytes()
               for i in np.random.default_rng(2).choice(n_keys // PROMPT_BLOCKS, size=min(64, n_keys // PROMPT_BLOCKS),
                                                        replace=False)]
    workers = max(args.candidates, args.nodes)
    results: dict[str, Any] = {"lookup": [], "cost": {}, "bytes_per_entry": {}, "memory": [],
                               "setup": {"keys": n_keys, "nodes": args.nodes, "workers": workers,
                                         "prompt_blocks": PROMPT_BLOCKS, "seconds": args.seconds,
                                         "rounds": args.rounds}}
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        master = subprocess.Popen([sys.executable, "-m", "kvtier.master", "--bind", "tcp://127.0.0.1:*",
                                   "--metrics-port", "-1", "--lease-s", "3600", "--ready-file", str(ready),
                                   "--log-level", "warning"])
        echo_q, echo_stop = ctx.Queue(), ctx.Event()
        echo = ctx.Process(target=_echo_server, args=(echo_q, echo_stop))
        echo.start()
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if master.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvtier-master did not start")
                time.sleep(0.05)
            endpoint = json.loads(ready.read_text())["endpoint"]
            echo_endpoint = echo_q.get(timeout=60)
            rss0 = _rss(master.pid)
            t0 = time.perf_counter()
            _populate(endpoint, keys, args.nodes, workers)
            from kvtier.client import MasterClient

            with MasterClient(endpoint) as m:
                info = m.ping()
            results["setup"]["populate_s"] = round(time.perf_counter() - t0, 1)
            results["setup"]["daemon_rss_bytes_per_entry"] = round((_rss(master.pid) - rss0) / info["keys"], 1)
            results["setup"]["daemon_array_bytes_per_entry"] = round(info["directory_bytes"] / info["keys"], 1)
            print(f"kvtier bench master: {info['keys']:,} keys over {args.nodes} nodes ({workers} workers) loaded "
                  f"in {results['setup']['populate_s']} s; medians of {args.rounds} rounds of {args.seconds:g} s; "
                  "shared machine: compare ratios")
            for n in clients:
                rounds = []
                for _ in range(args.rounds):
                    base = _run_clients(ctx, echo_endpoint, prompts, n, args.seconds, raw=True)
                    got = _run_clients(ctx, endpoint, prompts, n, args.seconds, raw=False)
                    rounds.append((got, base))
                row = {"clients": n,
                       "keys_per_s": round(median([g["keys_per_s"] for g, _ in rounds])),
                       "p50_ms": round(median([g["p50_ms"] for g, _ in rounds]), 3),
                       "p99_ms": round(median([g["p99_ms"] for g, _ in rounds]), 3),
                       "baseline_keys_per_s": round(median([b["keys_per_s"] for _, b in rounds])),
                       "baseline_p50_ms": round(median([b["p50_ms"] for _, b in rounds]), 3),
                       "baseline_p99_ms": round(median([b["p99_ms"] for _, b in rounds]), 3)}
                row["ratio"] = round(row["keys_per_s"] / row["baseline_keys_per_s"], 3)
                results["lookup"].append(row)
                print(f"  lookup 2000 keys, {n:>2} clients: {row['keys_per_s'] / 1e6:6.2f} M keys/s  p50 "
                      f"{row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms | zmq echo {row['baseline_keys_per_s'] / 1e6:.2f}"
                      f" M keys/s p50 {row['baseline_p50_ms']:.3f} ms | ratio {row['ratio']:.2f}")
            cands = [f"node-{w}" for w in range(args.candidates)]
            cost_rounds = []
            for _ in range(args.rounds):
                base = _run_clients(ctx, echo_endpoint, prompts, 1, args.seconds, raw=True)
                got = _run_clients(ctx, endpoint, prompts, 1, args.seconds, raw=False, cost_candidates=cands)
                cost_rounds.append((got, base))
            results["cost"] = {"candidates": args.candidates, "keys": PROMPT_BLOCKS,
                               "p50_ms": round(median([g["p50_ms"] for g, _ in cost_rounds]), 3),
                               "p99_ms": round(median([g["p99_ms"] for g, _ in cost_rounds]), 3),
                               "baseline_p50_ms": round(median([b["p50_ms"] for _, b in cost_rounds]), 3),
                               "baseline_p99_ms": round(median([b["p99_ms"] for _, b in cost_rounds]), 3)}
            c = results["cost"]
            c["ratio"] = round(c["p50_ms"] / c["baseline_p50_ms"], 2)
            print(f"  cost 2000 keys x {args.candidates} candidates: p50 {c['p50_ms']:.3f} ms  p99 {c['p99_ms']:.3f} ms"
                  f" | zmq echo p50 {c['baseline_p50_ms']:.3f} ms | latency ratio {c['ratio']:.2f}")
        finally:
            master.terminate()
            master.wait(60)
            echo_stop.set()
            echo.join(10)
    if args.masters:
        from kvtier.bench.master_shared import run_shared

        results["shared"] = run_shared(args, keys, prompts, _populate)
    for size in [int(s) for s in args.memory.split(",") if s.strip()]:
        mem = measure_memory(size)
        results["memory"].append(mem)
        results["bytes_per_entry"][str(size)] = mem["rss_bytes_per_entry"]
        print(f"  directory memory at {size:,} keys: {mem['rss_bytes_per_entry']:.1f} B/entry RSS "
              f"({mem['array_bytes_per_entry']:.1f} B/entry in arrays) | payload 24 B | ratio {mem['ratio']:.2f}")
    write_json(results, args.json)
    return 0
