"""Lookup latency of 2,000 present keys (a 128K-token prompt at 64-token blocks) on each path an engine host asks,
printed by ``kvtier bench tiers`` beside its DRAM rows (``--tier dram``: in process) and pool rows (``--tier
pool``: the pool over shm and over TCP, and the master). Each figure beside a physical baseline of the same path,
measured in the same run, rounds interleaved; p50 of ``REPS`` calls per round, medians over rounds:

  in-process contains       TieredStore.contains over its DRAM tier (embedded mode); baseline: the same keys
                            probed one by one in a Python set (the cheapest per-key answer Python has)
  in-process lookup_prefix  TieredStore.lookup_prefix of the same keys (length and runs); same baseline
  pool-shm contains         PoolConnection.contains over the pool's ipc socket (what standalone mode asks);
                            baseline: a zmq echo of the same request frame over ipc, in another process
  pool-tcp contains         the same over loopback TCP; baseline: the zmq echo over TCP
  master lookup             MasterClient.lookup of keys one registered node holds (what distributed mode asks:
                            one master RPC per batch); baseline: the zmq echo over TCP

``ratio`` is baseline time / lookup time (1.0: as fast as the baseline; below: slower).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench.common import median
from kvtier.keys import Namespace

KEYS = 2000
BLOCK_BYTES = 4096  # the lookups do not depend on it; small keeps the pool's DRAM small
REPS = 200
PATHS = {"dram": ("in-process",), "pool": ("pool-shm", "pool-tcp", "master")}


def _p50_us(fn: Callable[[], Any], reps: int = REPS) -> float:
    fn()  # warm: connections, caches
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        lat.append(time.perf_counter_ns() - t0)
    return statistics.median(lat) / 1e3


def _echo(endpoint: str, frame: bytes) -> Callable[[], None]:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)

    def once() -> None:
        sock.send(frame)
        sock.recv()
    return once


def _row(path: str, op: str, us: list[float], base_us: list[float], baseline: str) -> dict[str, Any]:
    p50, base = round(median(us), 1), round(median(base_us), 1)  # the ratio of the figures printed
    return {"tier": "lookup", "path": path, "op": op, "keys": KEYS, "p50_us": round(p50, 1),
            "baseline": baseline, "baseline_us": round(base, 1), "ratio": round(base / p50, 3)}


def bench_lookups(groups: Sequence[str], rounds: int) -> list[dict[str, Any]]:
    """Rows for the path groups named in ``groups`` ("in-process", "pool-shm", "pool-tcp", "master")."""
    torch.set_num_threads(1)
    keys = Namespace("bench-lookup").keys(range(KEYS))
    rows: list[dict[str, Any]] = []
    if "in-process" in groups:
        rows += _in_process(keys, rounds)
    remote = [g for g in groups if g != "in-process"]
    if remote:
        rows += _remote(keys, remote, rounds)
    return rows


def _in_process(keys: list[bytes], rounds: int) -> list[dict[str, Any]]:
    from kvtier.store import TieredStore

    store = TieredStore.from_config({"dram_capacity": 2 * KEYS * BLOCK_BYTES}, BLOCK_BYTES)
    store.put(keys, torch.zeros(KEYS, BLOCK_BYTES, dtype=torch.uint8))
    if not all(store.contains(keys)) or store.lookup_prefix(keys).length != KEYS:
        raise RuntimeError("lookup bench: the store lost keys it was given")
    held = set(keys)
    t: dict[str, list[float]] = {"set": [], "contains": [], "lookup_prefix": []}
    for _ in range(rounds):
        t["set"].append(_p50_us(lambda: [k in held for k in keys]))
        t["contains"].append(_p50_us(lambda: store.contains(keys)))
        t["lookup_prefix"].append(_p50_us(lambda: store.lookup_prefix(keys)))
    store.close()
    base = "Python set probe, per key"
    return [_row("in-process", "contains", t["contains"], t["set"], base),
            _row("in-process", "lookup_prefix", t["lookup_prefix"], t["set"], base)]


def _remote(keys: list[bytes], groups: list[str], rounds: int) -> list[dict[str, Any]]:
    from kvtier import wire
    from kvtier.bench.master import _echo_server, _populate
    from kvtier.bench.master_shared import _Master
    from kvtier.client import MasterClient
    from kvtier.pool.process import PoolDaemon
    from kvtier.transport import connect

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-lookup-") as tmp, \
            PoolDaemon(2 * KEYS * BLOCK_BYTES, BLOCK_BYTES, ipc=True) as pool:
        echoes, queues = {}, {}
        for scheme, bind in (("tcp", "tcp://127.0.0.1"), ("ipc", f"ipc://{tmp}/echo")):
            queues[scheme] = ctx.Queue()
            echoes[scheme] = ctx.Process(target=_echo_server, args=(queues[scheme], stop, bind), daemon=True)
            echoes[scheme].start()
        master = _Master(Path(tmp), "master", []) if "master" in groups else None
        conns = []
        try:
            frame = wire.encode_request(1, wire.LOOKUP, {"keys": b"".join(keys)})  # a 2,000-key request's size
            echo = {s: _echo(q.get(timeout=60), frame) for s, q in queues.items()}
            paths: dict[str, tuple[Callable[[], Any], str]] = {}
            for group, scheme, transport in (("pool-shm", "ipc", "shm"), ("pool-tcp", "tcp", "tcp")):
                if group in groups:
                    at = pool.endpoint(scheme)
                    conn = connect(at, BLOCK_BYTES, transport=transport, timeout_s=30.0, auth=pool.client_auth(at))
                    conns.append(conn)
                    rows_np = np.zeros((KEYS, BLOCK_BYTES), np.uint8)
                    ptrs = np.uint64(rows_np.ctypes.data) + np.arange(KEYS, dtype=np.uint64) * np.uint64(BLOCK_BYTES)
                    if not all(conn.put(keys, ptrs)) or not all(conn.contains(keys)):
                        raise RuntimeError(f"lookup bench: the pool over {transport} lost keys it was given")
                    paths[group] = (lambda c=conn: c.contains(keys), scheme)
            if master is not None:
                key_array = np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2)
                _populate(master.endpoint, key_array, 1, 1)
                client = MasterClient(master.endpoint, timeout_s=30.0)
                conns.append(client)
                if client.lookup(key_array.tobytes()).any != KEYS:
                    raise RuntimeError("lookup bench: the master does not know the keys it was given")
                paths["master"] = (lambda: client.lookup(key_array.tobytes()), "tcp")
            t: dict[str, list[float]] = {}
            for _ in range(rounds):
                for group, (fn, scheme) in paths.items():
                    t.setdefault(group + " base", []).append(_p50_us(echo[scheme]))
                    t.setdefault(group, []).append(_p50_us(fn))
            for group, (_, scheme) in paths.items():
                rows.append(_row(group, "lookup" if group == "master" else "contains", t[group],
                                 t[group + " base"], f"zmq echo of the request over {scheme}"))
        finally:
            for c in conns:
                c.close()
            if master is not None:
                master.stop()
            stop.set()
            for p in echoes.values():
                p.join(10)
    return rows


def print_lookups(rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"\nlookup of {KEYS} present keys  (p50 us, medians over rounds; ratio: baseline time / lookup time)")
    print(f"{'path':>12}{'op':>15}{'p50 us':>10}{'baseline us':>13}{'ratio':>8}  baseline")
    for r in rows:
        print(f"{r['path']:>12}{r['op']:>15}{r['p50_us']:>10.1f}{r['baseline_us']:>13.1f}{r['ratio']:>8.2f}  "
              f"{r['baseline']}")
