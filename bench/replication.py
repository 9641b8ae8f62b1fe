"""``kvtier bench replication``: when hot-block replication pays: hits kept through a pool's death, and the read
load spread over pools, with replication on beside the same run with it off (the baseline).

Each setup: a real kvtier-master (``--replicate-heat`` H, or off), ``--pools`` real kvtier-pools registered with
it, ``--prefixes`` prefixes of ``--blocks`` blocks each stored through the master's placements (route_put, then
a put to the named pool, as a PoolTier does). Readers then read whole prefixes as a distributed store does
(``locate`` on the master, a get from the pool it names, bytes checked against the key): ``--hot`` of the
prefixes take ``--hot-share`` of the reads.

1. warm: ``--seconds`` of reads (heat builds; with replication on, hot prefixes get a copy on another pool);
2. spread: ``--seconds`` of reads; the share of hot-prefix blocks the busiest pool served (1/pools is even);
3. kill -9 of the pool holding most hot blocks' first copy; after its lease, ``--seconds`` of reads: the share
   of hot (and of all) blocks still read bit-exact from a live pool.

Printed per setup beside the replication-off setup of the same run, with the ratio; the extra pool memory
replicas take is shown too (what the hits cost).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.common import write_json


class _Daemon:
    def __init__(self, tmp: Path, name: str, cmd: list[str]) -> None:
        self.ready = tmp / f"{name}.ready"
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, *cmd, "--ready-file", str(self.ready), "--log-level", "warning"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {(tmp / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.info = json.loads(self.ready.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self.log.close()


def _block(key: bytes, nbytes: int) -> np.ndarray:
    """Bytes that depend only on the key (any reader can check any writer's block)."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def _setup(tmp: Path, args: argparse.Namespace, heat: float, tag: str) -> dict[str, Any]:
    from kvtier.client import MasterClient
    from kvtier.keys import Namespace
    from kvtier.transport import connect

    bb = args.block_bytes
    master = _Daemon(tmp, f"{tag}-master", ["-m", "kvtier.master", "--bind", "tcp://127.0.0.1:*", "--metrics-port",
                                            "-1", "--lease-s", str(args.lease_s), "--replicate-heat", str(heat),
                                            "--replicate-interval-s", "0.5", "--heat-half-life-s", "60"])
    endpoint = master.info["endpoint"]
    pools = [_Daemon(tmp, f"{tag}-pool{i}", ["-m", "kvtier.pool", "--bind", "tcp://127.0.0.1:*", "--capacity",
                                             str(args.pool_capacity), "--block-bytes", str(bb), "--rdma", "off",
                                             "--master", endpoint, "--heartbeat-s", "0.2",
                                             "--shm-dir", str(tmp)]) for i in range(args.pools)]
    out: dict[str, Any] = {"replicate_heat": heat}
    conns: dict[str, Any] = {}
    try:
        m = MasterClient(endpoint, timeout_s=10.0)
        deadline = time.monotonic() + 60
        while sum(n["state"] == "live" for n in m.nodes()) < args.pools:
            if time.monotonic() > deadline:
                raise RuntimeError("pools did not register")
            time.sleep(0.1)
        ns = Namespace(f"bench-replication-{tag}")
        prefixes = [ns.keys(range(p * args.blocks, (p + 1) * args.blocks)) for p in range(args.prefixes)]

        def conn(address: str) -> Any:
            if address not in conns:
                conns[address] = connect(address, bb, timeout_s=1.0)
            return conns[address]

        for keys in prefixes:  # stored through the master's placements, as a PoolTier stores
            targets = m.route_put([bb] * len(keys), "bench-writer", keys, labels={"role": "pool"})
            addresses = {n["node"]: n["address"] for n in m.nodes()}
            by_pool: dict[str, list[bytes]] = {}
            for k, t in zip(keys, targets):
                by_pool.setdefault(addresses[t[0]], []).append(k)
            for address, ks in by_pool.items():
                src = np.stack([_block(k, bb) for k in ks])
                rows = np.uint64(src.ctypes.data) + np.arange(len(ks), dtype=np.uint64) * np.uint64(bb)
                conn(address).put(ks, rows)
        everything = [k for keys in prefixes for k in keys]
        while m.lookup(everything, touch=False).any < len(everything):
            time.sleep(0.05)
        hot_n = max(1, int(args.prefixes * args.hot))
        rng = np.random.default_rng(7)
        buf = np.empty((args.blocks, bb), np.uint8)
        rows = np.uint64(buf.ctypes.data) + np.arange(args.blocks, dtype=np.uint64) * np.uint64(bb)

        def read(seconds: float) -> dict[str, Any]:
            served: dict[str, int] = {}
            asked = {"hot": 0, "all": 0}
            hits = {"hot": 0, "all": 0}
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                hot = rng.random() < args.hot_share
                p = int(rng.integers(hot_n)) if hot else int(rng.integers(hot_n, args.prefixes))
                keys = prefixes[p]
                found = m.locate(keys, {"role": "pool"})
                by: dict[str, list[int]] = {}
                for i, w in enumerate(found.where):
                    if w >= 0:
                        by.setdefault(found.holders[w][2], []).append(i)
                got = 0
                for address, idx in by.items():
                    try:
                        ok = conn(address).get([keys[i] for i in idx], rows[idx])
                    except Exception:
                        conns.pop(address, None)
                        continue
                    for i, h in zip(idx, ok):
                        if h and np.array_equal(buf[i], _block(keys[i], bb)):
                            got += 1
                            if hot:
                                served[address] = served.get(address, 0) + 1
                for kind in ("all", "hot") if hot else ("all",):
                    asked[kind] += len(keys)
                    hits[kind] += got
            return {"served": served, "hit_rate": {k: hits[k] / asked[k] if asked[k] else 0.0 for k in asked}}

        first = m.locate([k for keys in prefixes[:hot_n] for k in keys], {"role": "pool"}, touch=False)
        holders = [first.holders[w][2] for w in first.where if w >= 0]
        victim_address = max(set(holders), key=holders.count)  # the pool with most hot blocks' first copy
        read(args.seconds)  # warm: heat builds, replication (if on) copies
        time.sleep(2.0)  # a replication round and the copies' events
        hot_keys = [k for keys in prefixes[:hot_n] for k in keys]
        counts = m.lookup(hot_keys, touch=False)
        out["hot_blocks"] = len(hot_keys)
        out["hot_blocks_on_two_pools"] = _on_two(m, hot_keys)
        spread = read(args.seconds)
        total = sum(spread["served"].values()) or 1
        out["busiest_pool_share"] = round(max(spread["served"].values(), default=0) / total, 3)
        out["replica_bytes"] = int(sum(n["tiers"][0]["used"] for n in m.nodes()) - len(everything) * bb)
        victim = next(p for p in pools if victim_address in p.info["endpoints"])
        victim.proc.kill()
        victim.proc.wait(10)
        conns.pop(victim_address, None)
        time.sleep(args.lease_s + 1.0)
        after = read(args.seconds)
        out["hot_hit_rate_after_death"] = round(after["hit_rate"]["hot"], 3)
        out["all_hit_rate_after_death"] = round(after["hit_rate"]["all"], 3)
        out["counts_before_kill"] = counts.any
        m.close()
    finally:
        for c in conns.values():
            c.close()
        for p in pools:
            p.stop()
        master.stop()
    return out


def _on_two(m: Any, keys: list[bytes]) -> int:
    """Hot blocks two or more live pools hold (from the master's per-node prefix counts, block by block)."""
    n = 0
    for k in keys:
        n += sum(1 for h in m.lookup([k], touch=False).hits if h.blocks) >= 2
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pools", type=int, default=3, help="pools (default 3)")
    p.add_argument("--prefixes", type=int, default=48, help="prefixes stored (default 48)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per prefix (default 16)")
    p.add_argument("--block-bytes", type=int, default=64 << 10, help="block size (default 64 KiB)")
    p.add_argument("--pool-capacity", type=int, default=256 << 20, help="bytes per pool (default 256 MiB)")
    p.add_argument("--hot", type=float, default=0.125, help="share of prefixes that are hot (default 0.125)")
    p.add_argument("--hot-share", type=float, default=0.8, help="share of reads that go to hot prefixes (0.8)")
    p.add_argument("--heat", type=float, default=30.0, help="--replicate-heat of the replicated setup (default 30: "
                   "above what the cold prefixes reach in a phase, so only the hot ones are copied)")
    p.add_argument("--lease-s", type=float, default=2.0, help="the master's lease (default 2)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per phase (default 4)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        off = _setup(tmp, args, 0.0, "off")
        on = _setup(tmp, args, args.heat, "on")
    res = {"off": off, "on": on, "setup": {k: getattr(args, k) for k in ("pools", "prefixes", "blocks", "block_bytes",
                                                                      "hot", "hot_share", "heat", "seconds")}}
    even = 1 / args.pools

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "inf"

    print(f"kvtier bench replication: {args.pools} pools, {args.prefixes} prefixes x {args.blocks} blocks of "
          f"{args.block_bytes >> 10} KiB, {args.hot:.0%} of prefixes take {args.hot_share:.0%} of reads; "
          f"--replicate-heat {args.heat:g} beside replication off")
    print(f"  hot blocks on two pools: {on['hot_blocks_on_two_pools']} of {on['hot_blocks']} | off "
          f"{off['hot_blocks_on_two_pools']}; extra pool memory {on['replica_bytes'] / 2**20:.1f} MiB")
    print(f"  busiest pool's share of hot reads: {on['busiest_pool_share']:.1%} | off {off['busiest_pool_share']:.1%}"
          f" | ratio {ratio(on['busiest_pool_share'], off['busiest_pool_share'])} (even: {even:.1%})")
    print(f"  after kill -9 of the pool with most hot blocks: hot hit rate {on['hot_hit_rate_after_death']:.1%} | "
          f"off {off['hot_hit_rate_after_death']:.1%} | ratio "
          f"{ratio(on['hot_hit_rate_after_death'], off['hot_hit_rate_after_death'])}; all blocks "
          f"{on['all_hit_rate_after_death']:.1%} | off {off['all_hit_rate_after_death']:.1%}")
    write_json(res, args.json)
    return 0
