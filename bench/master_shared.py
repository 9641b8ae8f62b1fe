"""``kvtier bench master --masters 1,2,3 [--directory redis://...]``: several masters sharing one directory in
Redis, beside the lmdb single master, in the same run.

* Setups: the lmdb single master (``--data-dir``: the default deployment, the baseline) and, for each N of
  ``--masters``, N masters started with ``--directory`` (a fresh Redis database each; without ``--directory``
  the bench starts its own redis-server from Debian's package). Each gets the same directory through the node
  protocol (via its first master) and waits until every master holds all of it.
* Lookups: ``--shared-clients`` client processes, client i asking master i % N (as routers spread over masters),
  2,000-key lookups for ``--seconds``; keys/s, p50/p99, and keys per CPU-second of the masters (their
  utime+stime over the measurement: on a 2-core machine the clients and masters share the cores, so keys/s
  cannot show scaling, CPU efficiency can). Rounds interleave the setups; medians are reported, each beside the
  lmdb master's figure of the same round (ratio = setup / lmdb).
* Staleness: a node adds one fresh key through master 0 (an events message, acknowledged once master 0 applied
  it from the log); a reader polls master 1 until it holds the key: p50/p99 of ack -> visible, and of the
  write's round trip itself (beside the lmdb master's write round trip).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import median

PROMPT_BLOCKS = 2000


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Master:
    def __init__(self, tmp: Path, name: str, args: list[str]) -> None:
        self.ready = tmp / f"{name}.ready"
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.master", "--bind", "tcp://127.0.0.1:*",
                                      "--metrics-port", "-1", "--lease-s", "3600", "--ready-file", str(self.ready),
                                      "--log-level", "warning", *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtier-master {name} did not start: {(tmp / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.endpoint = json.loads(self.ready.read_text())["endpoint"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def _redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("--masters without --directory starts a redis-server: apt-get install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def _wait_loaded(endpoints: list[str], keys: int) -> None:
    from kvtier.client import MasterClient

    for e in endpoints:
        with MasterClient(e, timeout_s=30.0) as m:
            deadline = time.monotonic() + 300
            while m.ping()["keys"] < keys:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"master {e} did not catch up with the shared directory")
                time.sleep(0.1)


def _lookup_client(endpoint: str, prompts: list[bytes], seconds: float, ready: Any, go: Any, out: Any,
                   seed: int) -> None:
    from kvtier.client import MasterClient

    rng = np.random.default_rng(seed)
    lat: list[float] = []
    with MasterClient(endpoint, timeout_s=30.0) as c:
        c.lookup(prompts[0])
        ready.put(1)
        go.wait()
        t_end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < t_end:
            c.lookup(prompts[int(rng.integers(len(prompts)))])
            lat.append(time.perf_counter() - t0)
    out.put(lat)


def _measure(ctx: Any, masters: list[_Master], prompts: list[bytes], clients: int, seconds: float) -> dict[str, float]:
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_lookup_client, args=(masters[i % len(masters)].endpoint, prompts, seconds, ready,
                                                      go, out, i)) for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    cpu0 = sum(_cpu_s(m.proc.pid) for m in masters)
    t0 = time.perf_counter()
    go.set()
    lats = [out.get(timeout=seconds + 120) for _ in procs]
    wall = time.perf_counter() - t0
    cpu = sum(_cpu_s(m.proc.pid) for m in masters) - cpu0
    for p in procs:
        p.join(30)
    flat = np.concatenate([np.asarray(x) for x in lats]) * 1e3
    keys = len(flat) * PROMPT_BLOCKS
    return {"keys_per_s": keys / wall, "p50_ms": float(np.percentile(flat, 50)),
            "p99_ms": float(np.percentile(flat, 99)),
            "keys_per_cpu_s": keys / max(cpu, 1e-9), "master_cpu_s": cpu}


def _staleness(writer: str, reader: str, samples: int) -> dict[str, float]:
    """Ack on ``writer`` -> visible on ``reader`` (and the write's round trip), per fresh key."""
    from kvtier import wire
    from kvtier.client import MasterClient, api

    rng = np.random.default_rng(99)
    visible, writes = [], []
    with MasterClient(writer, timeout_s=10.0) as w, MasterClient(reader, timeout_s=10.0) as r:
        w.call(api.register("stale-probe", "probe", 0, [("dram", 1 << 40)]))
        w.call(api.inventory("stale-probe", "probe", 0, 0, True, {}, {}))
        for seq in range(1, samples + 1):
            key = rng.integers(0, 2**63, size=(1, 2), dtype=np.uint64).tobytes()
            t0 = time.perf_counter()
            w.call(api.events("stale-probe", "probe", seq, [(wire.ADD, "dram", key, 4096)]))
            acked = time.perf_counter()
            while r.lookup(key, touch=False).any != 1:
                pass
            visible.append(time.perf_counter() - acked)
            writes.append(acked - t0)
    v, wr = np.asarray(visible) * 1e3, np.asarray(writes) * 1e3
    return {"visible_p50_ms": float(np.percentile(v, 50)), "visible_p99_ms": float(np.percentile(v, 99)),
            "write_p50_ms": float(np.percentile(wr, 50)), "write_p99_ms": float(np.percentile(wr, 99))}


def _failover(tmp: Path, ms: list[_Master], args: list[str], prompts: list[bytes], timeout_s: float = 0.5,
              seconds: float = 4.0) -> dict[str, float]:
    """kill -9 of the master a client is using, mid-traffic: the longest lookup (the failover time), the
    lookups that failed, how long a write waits to be recorded; then how long a new master takes to load the
    directory (snapshot + log) and serve."""
    from kvtier import wire
    from kvtier.client import MasterClient, MasterError, api

    lat, failed = [], 0
    everyone = [m.endpoint for m in ms]
    with MasterClient(everyone, timeout_s=timeout_s) as c, MasterClient(everyone, timeout_s=timeout_s) as w:
        c.lookup(prompts[0], touch=False)  # both clients now prefer master 0
        w.call(api.register("failover-probe", "probe", 0, [("dram", 1 << 40)]))
        w.call(api.inventory("failover-probe", "probe", 0, 0, True, {}, {}))
        t_end = time.perf_counter() + seconds
        killed_at = t_end - seconds / 2
        killed = False
        while (t0 := time.perf_counter()) < t_end:
            if not killed and t0 >= killed_at:
                ms[0].proc.kill()
                ms[0].proc.wait(10)
                killed = True
                continue
            try:
                c.lookup(prompts[int(t0 * 1000) % len(prompts)], touch=False)
            except MasterError:
                failed += 1
            lat.append(time.perf_counter() - t0)
        w0 = time.perf_counter()
        w.call(api.events("failover-probe", "probe", 1, [(wire.ADD, "dram", b"\1" * 16, 4096)]))
        write_s = time.perf_counter() - w0
    t0 = time.perf_counter()
    ms[0] = _Master(tmp, "restarted", args)
    restart_s = time.perf_counter() - t0
    return {"timeout_s": timeout_s, "worst_lookup_s": round(max(lat), 3), "failed_lookups": failed,
            "lookups": len(lat), "write_after_kill_s": round(write_s, 3), "restart_to_serving_s": round(restart_s, 2)}


def run_shared(args: Any, keys: np.ndarray, prompts: list[bytes], populate: Any) -> dict[str, Any]:
    counts = [int(c) for c in args.masters.split(",") if c.strip()]
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"clients": args.shared_clients, "rows": [], "staleness": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        redis_proc = None
        url = args.directory
        if not url:
            redis_proc, url = _redis(tmp)
        out["directory"] = url
        setups: dict[str, list[_Master]] = {}
        try:
            setups["lmdb"] = [_Master(tmp, "lmdb", ["--data-dir", str(tmp / "lmdb-data")])]
            base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
            for db, n in enumerate(counts, start=1):  # a fresh Redis database per setup
                setups[f"redis x{n}"] = [_Master(tmp, f"r{n}-{i}", ["--directory", f"{base}/{db}"]) for i in range(n)]
            for name, ms in setups.items():
                populate(ms[0].endpoint, keys, args.nodes, args.nodes)
                _wait_loaded([m.endpoint for m in ms], len(keys))
            print(f"  shared directory: {len(keys):,} keys in each setup; {args.shared_clients} client processes, "
                  f"client i on master i % N; medians of {args.rounds} rounds, beside the lmdb master")
            rounds: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
            for _ in range(args.rounds):
                for name, ms in setups.items():
                    rounds[name].append(_measure(ctx, ms, prompts, args.shared_clients, args.seconds))
            base_rounds = rounds["lmdb"]
            for name, got in rounds.items():
                row = {"setup": name, "masters": len(setups[name])}
                for k in ("keys_per_s", "p50_ms", "p99_ms", "keys_per_cpu_s"):
                    row[k] = round(median([g[k] for g in got]), 3)
                    row[f"baseline_{k}"] = round(median([b[k] for b in base_rounds]), 3)
                row["ratio"] = round(median([g["keys_per_s"] / b["keys_per_s"] for g, b in zip(got, base_rounds)]), 3)
                row["cpu_ratio"] = round(median([g["keys_per_cpu_s"] / b["keys_per_cpu_s"]
                                                 for g, b in zip(got, base_rounds)]), 3)
                out["rows"].append(row)
                print(f"  {name:<9} lookup 2000 keys: {row['keys_per_s'] / 1e6:6.2f} M keys/s  "
                      f"p50 {row['p50_ms']:.3f} ms"
                      f"  p99 {row['p99_ms']:.3f} ms  {row['keys_per_cpu_s'] / 1e6:.2f} M keys/CPU-s | lmdb "
                      f"{row['baseline_keys_per_s'] / 1e6:.2f} M keys/s p99 {row['baseline_p99_ms']:.3f} ms "
                      f"{row['baseline_keys_per_cpu_s'] / 1e6:.2f} M keys/CPU-s | ratio {row['ratio']:.2f}, "
                      f"per CPU-s {row['cpu_ratio']:.2f}")
            multi = [name for name, ms in setups.items() if len(ms) >= 2]
            lmdb_w = _staleness(setups["lmdb"][0].endpoint, setups["lmdb"][0].endpoint, args.staleness_samples)
            for name in multi:
                ms = setups[name]
                st = _staleness(ms[0].endpoint, ms[1].endpoint, args.staleness_samples)
                st["baseline_write_p50_ms"] = round(lmdb_w["write_p50_ms"], 3)
                st["write_ratio"] = round(st["write_p50_ms"] / lmdb_w["write_p50_ms"], 2)
                out["staleness"][name] = {k: round(v, 3) for k, v in st.items()}
                print(f"  {name:<9} staleness (acked on master 0 -> visible on master 1, {args.staleness_samples} "
                      f"writes): p50 {st['visible_p50_ms']:.3f} ms  p99 {st['visible_p99_ms']:.3f} ms | write round "
                      f"trip p50 {st['write_p50_ms']:.3f} ms p99 {st['write_p99_ms']:.3f} ms vs lmdb master "
                      f"{lmdb_w['write_p50_ms']:.3f} ms (ratio {st['write_ratio']:.2f})")
            if multi:
                name = multi[-1]
                db = counts.index(len(setups[name])) + 1
                fo = _failover(tmp, setups[name], ["--directory", f"{base}/{db}"], prompts)
                out["failover"] = {"setup": name, **fo}
                print(f"  {name:<9} kill -9 of the client's master mid-traffic: longest lookup "
                      f"{fo['worst_lookup_s']:.3f} s (client timeout {fo['timeout_s']:g} s), {fo['failed_lookups']} "
                      f"of {fo['lookups']} lookups failed; "
                      f"a write right after it recorded in {fo['write_after_kill_s']:.3f} s; a new master loaded "
                      f"{len(keys):,} keys and served after {fo['restart_to_serving_s']:.2f} s")
        finally:
            for ms in setups.values():
                for m in ms:
                    m.stop()
            if redis_proc is not None:
                redis_proc.kill()
                redis_proc.wait(10)
    return out
