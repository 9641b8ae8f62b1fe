"""``kvtier bench soak``: a small cluster under mixed traffic for a while, optionally with crashes, checked byte for
byte.

    kvtier bench soak --duration 60 --clients 16 --faults --json soak.json

Starts a kvtier-master (lmdb data dir), two kvtier-pools registered with it as the distributed commands of
docs/pool.md do (no --block-bytes: the first put sizes them) and ``--clients`` engine-like processes, each with a
distributed TieredStore (small private DRAM over the pools, placed and found by the master). Each client
loops until the deadline: puts batches of fresh keys, gets batches of keys any client may have put, looks
prefixes up; every block's content is derived from its key alone (the key tiled over the block, XOR its
byte offsets), so every hit is checked byte for byte, whoever wrote it. With ``--faults`` one pool is killed
(kill -9) a third of the way in and the master two thirds in; each is restarted on the same endpoint two
seconds later (the master on its data dir). The daemons' RSS is sampled twice a second.

What counts (the JSON's fields):

* ``ops``: store calls made (put, get, lookup batches); ``hits`` / ``misses``: blocks a get found or not.
  A miss is never an error: blocks are evicted, a killed pool's blocks are gone, a dead master finds none.
* ``errors``: exceptions out of a store call (the store turns every pool or master failure into a miss or a
  not-stored; an exception is a bug), and client processes that died. ``error_samples`` quotes a few.
* ``wrong_bytes``: blocks a get reported as hits whose bytes are not their key's. Must be 0.
* ``p50_ms`` / ``p99_ms``: latency of store calls, all ops together (``per_op`` has each op's).
* ``timeline``: ops, hits, misses and errors per two seconds (seconds since start, as the faults'), so a
  recovery after each fault can be read off; ``pool_writes``: the clients' write-behind counts (``failed``
  and ``no_pool_blocks``: blocks not placed while the master or a pool was down or too slow).
* ``rss``: per daemon, [seconds since start, MiB] samples (``traffic_from_s``: when the clients began);
  ``rss_growth_pct``: per daemon, its RSS over the last tenth of its traffic against the second fifth of it
  (after warm-up; the pools are sized at start, so their DRAM is in it; a restarted daemon counts from its
  restart), and the largest of those as ``rss_growth_pct`` itself.

Runs in the calling process (the daemons and clients are subprocesses it owns; all are stopped on exit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.units import format_bytes, parse_bytes

SAMPLE_S = 0.5
TIMELINE_S = 2.0  # the report's timeline of ops, hits and misses: one row per this many seconds
START_TIMEOUT_S = 120.0
FAULT_RESTART_S = 2.0
SERVE_BETWEEN_FAULTS_S = 4.0  # at least this long between a restart and the next fault
BATCH = 8


# ---- the client processes --------------------------------------------------------------------------------

def block_of(key: bytes, block_bytes: int, offsets: Any) -> Any:
    """The content of ``key``'s block: the key tiled over it, XOR the low byte of each offset."""
    import numpy as np

    return np.tile(np.frombuffer(key, np.uint8), block_bytes // len(key)) ^ offsets


def client_main(spec: dict[str, Any]) -> dict[str, Any]:
    """One client's loop (run in its own process): returns its counts and latencies."""
    import logging

    import numpy as np
    import torch

    from kvtier.keys import Namespace
    from kvtier.store import TieredStore

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s client %(message)s")
    bb, me, clients = spec["block_bytes"], spec["index"], spec["clients"]
    ns = Namespace("kvtier-soak")
    offsets = (np.arange(bb) & 0xFF).astype(np.uint8)
    rng = random.Random(spec["seed"])
    counts = {"ops": 0, "put": 0, "get": 0, "lookup": 0, "hits": 0, "misses": 0, "stored": 0, "errors": 0,
              "wrong_bytes": 0}
    latency: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
    samples: list[str] = []
    written = 0  # this client's keys: (me, 0..written)
    window = spec["window"]
    seen = [0, 0, 0]  # hits, misses, errors counted into the timeline so far
    config = {"mode": "distributed", "master": spec["master"], "node_id": f"soak-client-{me}",
              "dram_capacity": spec["dram_bytes"], "pool_timeout_ms": spec["timeout_ms"], "copy_threads": 1}

    def key(client: int, seq: int) -> bytes:
        return ns.keys([client * 1_000_000_000 + seq])[0]

    with TieredStore.from_config(config, bb) as store:
        out = torch.empty(BATCH, bb, dtype=torch.uint8)
        print("ready", flush=True)  # then wait for the parent's go: every client starts (and ends) together
        end, begin = (float(x) for x in sys.stdin.readline().split())
        deadline = time.monotonic() + (end - time.time())
        timeline: dict[int, list[int]] = {}  # TIMELINE_S buckets since the run began: ops, hits, misses, errors
        while time.monotonic() < deadline:
            r = rng.random()
            op = "put" if r < 0.35 or written < BATCH else ("get" if r < 0.85 else "lookup")
            t0 = time.perf_counter()
            try:
                if op == "put":
                    keys = [key(me, written + i) for i in range(BATCH)]
                    blocks = torch.from_numpy(np.stack([block_of(k, bb, offsets) for k in keys]))
                    counts["stored"] += store.put(keys, blocks).stored
                    written += BATCH
                elif op == "get":  # recent keys (what the pools can still hold) of anyone: all write at one pace
                    owner = rng.randrange(clients)
                    keys = [key(owner, rng.randrange(max(0, written - window), written)) for _ in range(BATCH)]
                    hit = store.get(keys, out)
                    for i, (k, h) in enumerate(zip(keys, hit)):
                        if not h:
                            counts["misses"] += 1
                        elif np.array_equal(out[i].numpy(), block_of(k, bb, offsets)):
                            counts["hits"] += 1
                        else:
                            counts["wrong_bytes"] += 1
                            if len(samples) < 5:
                                samples.append(f"client {me}: wrong bytes for key {k.hex()}")
                else:
                    start = rng.randrange(max(1, written))
                    store.lookup_prefix([key(me, start + i) for i in range(2 * BATCH)])
            except Exception as e:  # an exception out of the store: an error (misses are not)
                counts["errors"] += 1
                if len(samples) < 5:
                    samples.append(f"client {me}: {op}: {type(e).__name__}: {e}"[:300])
            latency[op].append((time.perf_counter() - t0) * 1e3)
            counts["ops"] += 1
            counts[op] += 1
            row = timeline.setdefault(int((time.time() - begin) // TIMELINE_S), [0, 0, 0, 0])
            row[0] += 1
            row[1], row[2], row[3] = row[1] + counts["hits"] - seen[0], row[2] + counts["misses"] - seen[1], \
                row[3] + counts["errors"] - seen[2]
            seen[:] = [counts["hits"], counts["misses"], counts["errors"]]
        pool = store.stats()["tiers"]["pool"]["extra"]
    return {"counts": counts, "latency_ms": latency, "samples": samples, "timeline": timeline,
            "pool_writes": {**pool["write_behind"], "no_pool_blocks": pool["no_pool_blocks"]}}


# ---- daemons --------------------------------------------------------------------------------------------

class _Daemon:
    """A daemon subprocess that writes a JSON ready file; restarted on the endpoint it first bound."""

    def __init__(self, name: str, cmd: list[str], bind: str, tmp: Path) -> None:
        self.name, self.cmd, self.bind, self.tmp = name, cmd, bind, tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.lives: list[list[tuple[float, float]]] = []  # RSS samples, one list per incarnation

    def start(self, t0: float) -> _Daemon:
        ready = self.tmp / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        log = open(self.tmp / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen([*self.cmd, "--bind", self.bind, "--ready-file", str(ready)], stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.tmp / f"{self.name}.log").read_text()[-2000:]
                raise RuntimeError(f"{self.name} did not start within {START_TIMEOUT_S:g} s (exit code "
                                   f"{self.proc.poll()}): {log}")
            time.sleep(0.02)
        self.info = json.loads(ready.read_text())
        self.bind = self.info.get("endpoint") or self.info["endpoints"][0]
        self.lives.append([])
        return self

    def sample(self, t: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return
        kib = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
        self.lives[-1].append((round(t, 2), round(kib / 1024, 1)))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def growth_pct(self, since: float) -> float | None:
        """RSS over the last tenth of each incarnation's traffic (samples from ``since`` on) against its second
        fifth (after warm-up: imports, first connections), the largest."""
        out = []
        for whole in self.lives:
            life = [x for x in whole if x[0] >= since]
            n = len(life)
            if n < 10:
                continue
            warm = statistics.median(m for _, m in life[n // 5 : 2 * n // 5 or 1])
            last = statistics.median(m for _, m in life[-max(1, n // 10):])
            out.append((last - warm) / warm * 100)
        return round(max(out), 1) if out else None


# ---- the run --------------------------------------------------------------------------------------------

def soak(duration_s: float, clients: int, faults: bool, *, block_bytes: int = 16 << 10,
         pool_capacity: int = 64 << 20, dram_bytes: int = 64 << 10 << 4, timeout_ms: int = 1000,
         seed: int = 0) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    py = sys.executable
    master = _Daemon("master", [py, "-m", "kvtier.master", "--data-dir", str(tmp / "master-data"), "--lease-s", "3",
                                "--metrics-port", "-1", "--log-level", "warning"], "tcp://127.0.0.1:*", tmp)
    pools: list[_Daemon] = []
    workers: list[subprocess.Popen[str]] = []
    t_start = time.monotonic()
    faults_done: list[dict[str, Any]] = []
    stop_sampling = threading.Event()
    try:
        master.start(t_start)
        for i in range(2):
            # Sized at start (--block-bytes), so each incarnation's DRAM is allocated and prefaulted before it
            # reports ready: an unsized pool restarted while the master is down allocated it at the first put
            # after the master's return, past the warm-up window, and read as 30% growth.
            pools.append(_Daemon(f"pool-{i}", [py, "-m", "kvtier.pool", "--master", master.bind, "--capacity",
                                               str(pool_capacity), "--block-bytes", str(block_bytes),
                                               "--heartbeat-s", "0.5", "--rdma", "off", "--prefault",
                                               "--shm-dir", str(tmp), "--log-level", "warning"],
                                 "tcp://127.0.0.1:*", tmp).start(t_start))
        daemons = [master, *pools]

        def sampler() -> None:
            while not stop_sampling.wait(SAMPLE_S):
                for d in daemons:
                    d.sample(time.monotonic() - t_start)
        threading.Thread(target=sampler, daemon=True).start()
        for i in range(clients):
            spec = {"index": i, "clients": clients, "block_bytes": block_bytes, "master": master.bind,
                    "dram_bytes": dram_bytes, "timeout_ms": timeout_ms, "seed": seed * 1000 + i,
                    "window": max(BATCH, 2 * pool_capacity // block_bytes // clients)}
            workers.append(subprocess.Popen([py, "-m", "kvtier.bench.soak", "--worker", json.dumps(spec)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=open(tmp / f"client-{i}.log", "w"), text=True))
        for i, w in enumerate(workers):  # all started (torch imported, store built) before the clock runs
            if w.stdout is None or w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"client {i} did not start: {(tmp / f'client-{i}.log').read_text()[-2000:]}")
        run_start = time.monotonic()
        begin = time.time()
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(f"{begin + duration_s} {begin}\n")
            w.stdin.flush()
        if faults:
            plan = [(duration_s / 3, pools[0]), (2 * duration_s / 3, master)]
            serving_since = run_start
            for at, victim in plan:
                # Each fault waits for its time, and for the cluster to have served SERVE_BETWEEN_FAULTS_S since
                # the last restart: on a busy 2-core machine a restarted pool took ~6 s to be ready, and a master
                # killed before it had served left no window in which to see it serve again.
                time.sleep(max(0.0, run_start + at - time.monotonic(),
                               serving_since + SERVE_BETWEEN_FAULTS_S - time.monotonic()))
                victim.kill()
                faults_done.append({"t_s": round(time.monotonic() - t_start, 1), "killed": victim.name})
                time.sleep(FAULT_RESTART_S)
                victim.start(t_start)
                serving_since = time.monotonic()
                faults_done.append({"t_s": round(serving_since - t_start, 1), "restarted": victim.name})
        results = []
        for i, w in enumerate(workers):
            out, _ = w.communicate(timeout=duration_s + START_TIMEOUT_S)
            try:
                results.append(json.loads(out.strip().splitlines()[-1]))
            except (json.JSONDecodeError, IndexError):
                log = (tmp / f"client-{i}.log").read_text()[-1500:]
                results.append({"counts": {"errors": 1}, "latency_ms": {},
                                "samples": [f"client {i} died (exit {w.returncode}): {log}"]})
        stop_sampling.set()
        return _report(results, daemons, faults_done, duration_s, clients, block_bytes, run_start - t_start)
    finally:
        stop_sampling.set()
        for w in workers:
            if w.poll() is None:
                w.kill()
        for d in [*pools, master]:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _report(results: list[dict[str, Any]], daemons: list[_Daemon], faults: list[dict[str, Any]], duration_s: float,
            clients: int, block_bytes: int, traffic_from: float) -> dict[str, Any]:
    total: dict[str, int] = {}
    lat: dict[str, list[float]] = {}
    samples: list[str] = []
    writes: dict[str, int] = {}
    timeline: dict[int, list[int]] = {}
    for r in results:
        for b, row in r.get("timeline", {}).items():
            acc = timeline.setdefault(int(b), [0, 0, 0, 0])
            for j, v in enumerate(row):
                acc[j] += v
        for k, v in r["counts"].items():
            total[k] = total.get(k, 0) + v
        for k, v in r.get("pool_writes", {}).items():
            writes[k] = writes.get(k, 0) + v
        for op, v in r["latency_ms"].items():
            lat.setdefault(op, []).extend(v)
        samples += r["samples"]
    every = sorted(x for v in lat.values() for x in v)

    def pct(v: list[float], q: float) -> float | None:
        return round(v[min(len(v) - 1, int(q * len(v)))], 2) if v else None
    growth = {d.name: d.growth_pct(traffic_from) for d in daemons}
    known = [g for g in growth.values() if g is not None]
    return {
        "ops": total.get("ops", 0), "errors": total.get("errors", 0), "wrong_bytes": total.get("wrong_bytes", 0),
        "hits": total.get("hits", 0), "misses": total.get("misses", 0), "stored": total.get("stored", 0),
        "ops_by_kind": {op: total.get(op, 0) for op in ("put", "get", "lookup")},
        "pool_writes": writes,
        "timeline": [{"t_s": round(traffic_from + b * TIMELINE_S, 1), "ops": r[0], "hits": r[1], "misses": r[2],
                      "errors": r[3]} for b, r in sorted(timeline.items())],
        "rss_growth_pct": max(known) if known else None, "rss_growth_pct_by_daemon": growth,
        "p50_ms": pct(every, 0.5), "p99_ms": pct(every, 0.99),
        "per_op": {op: {"n": len(v), "p50_ms": pct(sorted(v), 0.5), "p99_ms": pct(sorted(v), 0.99)}
                   for op, v in lat.items()},
        "rss": {d.name: [s for life in d.lives for s in life] for d in daemons},
        "faults": faults, "duration_s": duration_s, "clients": clients, "block_bytes": block_bytes,
        "traffic_from_s": round(traffic_from, 1),
        "error_samples": samples[:10],
    }


# ---- the command ----------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default 60)")
    p.add_argument("--clients", type=int, default=16, help="client processes (default 16)")
    p.add_argument("--faults", action="store_true", help="kill -9 a pool a third of the way in and the master two "
                   "thirds in; restart each two seconds later")
    p.add_argument("--block-bytes", default="16KiB", help="block size (default 16KiB)")
    p.add_argument("--pool-capacity", default="64MiB", help="each pool's capacity (default 64MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    report = soak(args.duration, args.clients, args.faults, block_bytes=parse_bytes(args.block_bytes),
                  pool_capacity=parse_bytes(args.pool_capacity), seed=args.seed)
    brief = {k: report[k] for k in ("ops", "errors", "wrong_bytes", "hits", "misses", "rss_growth_pct", "p50_ms",
                                    "p99_ms")}
    print(f"kvtier bench soak: {args.clients} clients, {args.duration:g} s, blocks of "
          f"{format_bytes(parse_bytes(args.block_bytes))}{', with faults' if args.faults else ''}")
    print(json.dumps(brief))
    print("rss growth per daemon (%):", json.dumps(report["rss_growth_pct_by_daemon"]))
    for f in report["faults"]:
        print("  fault:", json.dumps(f))
    for s in report["error_samples"]:
        print("  error:", s)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if report["errors"] == 0 and report["wrong_bytes"] == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(json.dumps(client_main(json.loads(sys.argv[2]))), flush=True)
    else:
        parser = argparse.ArgumentParser(prog="kvtier bench soak")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
