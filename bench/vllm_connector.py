"""``kvtier bench vllm``: the vLLM connector's worker data path, save and load GB/s beside memcpy.

A model's KV cache is allocated as vLLM 0.33 does on the CPU (per layer a (B, H, N, C) view of LBNHC
pages); the connector's own copy machinery (``PagedKV`` + ``Transfers`` + an embedded DRAM store) then
- saves N blocks: the store is asked which keys it lacks, and each block's layers are gathered straight into
  the DRAM slots the store reserved for it (``put_in_place``: one copy, 1.0x memcpy is the ceiling); with
  ``--staged-saves`` into host staging rows that ``put`` then copies into the slots (two copies: 0.5x), the
  path a store without addressable slots takes;
- loads them back into shuffled engine blocks, one scatter per layer (what makes per-layer readiness
  possible) straight from the DRAM slots (one copy: 1.0x is the ceiling).
Baseline: one ``np.copyto`` of the same bytes, measured in the same rounds. Timed from queueing the job to
its completion (medians; the first round warms up and checks the loaded bytes). Needs no vLLM install.
"""

from __future__ import annotations

import argparse
import random
import threading
from typing import Any

import numpy as np
import torch

from kvtier.bench.common import gbps, median, print_rows, row, time_once, write_json
from kvtier.connectors.vllm.pagedkv import PagedKV
from kvtier.connectors.vllm.transfer import LoadJob, SaveJob, Transfers
from kvtier.keys import Namespace
from kvtier.store.leases import LeaseTable
from kvtier.layout import MODELS
from kvtier.store import TieredStore
from kvtier.units import format_bytes, parse_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b",
                   choices=sorted(k for k, v in MODELS.items() if "num_kv_heads" in v))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: one rank's share of the KV heads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bytes", default="512MiB", help="KV moved per round (whole blocks)")
    p.add_argument("--staging", default="256MiB", help="the connector's staging_bytes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--staged-saves", action="store_true",
                   help="save through staging rows and put (two copies) instead of gathering into DRAM slots")
    p.add_argument("--json", default=None, help="write the rows here")


def run(args: argparse.Namespace) -> int:
    spec = MODELS[args.model]
    heads = max(1, spec["num_kv_heads"] // args.tp)
    layers, dim, bs = spec["num_layers"], spec["head_dim"], args.block_size
    block_bytes = layers * bs * heads * 2 * dim * 2
    n = max(1, parse_bytes(args.bytes) // block_bytes)
    kv_caches = {f"model.layers.{i}.self_attn.attn":
                 torch.randn(n, bs, heads, 2 * dim).to(torch.bfloat16).transpose(1, 2) for i in range(layers)}
    kv = PagedKV(kv_caches, list(kv_caches), bs)
    store = TieredStore.from_config({"dram_capacity": 2 * n * kv.layout.nbytes}, kv.layout)
    done: dict[str, threading.Event] = {}

    def finished(job: Any) -> None:
        done[job.req_id].set()

    transfers = Transfers(store, LeaseTable(store), kv, parse_bytes(args.staging), on_load_done=finished,
                          on_save_done=finished, save_in_place=not args.staged_saves)
    save_path = "in place" if transfers.saves_in_place else "staged"
    src = np.empty(n * kv.layout.nbytes, np.uint8)
    src.fill(7)
    dst = np.empty_like(src)
    ns = Namespace("bench-vllm", kv.layout.fingerprint)
    times: dict[str, list[float]] = {"save": [], "load": [], "memcpy": []}
    try:
        for rnd in range(args.rounds + 1):
            hashes = [rnd.to_bytes(4, "little") + i.to_bytes(28, "little") for i in range(n)]
            keys = ns.keys(hashes)
            ids = np.arange(n, dtype=np.int64)
            save = SaveJob(f"s{rnd}", keys, hashes, ids, kv)
            targets = np.array(random.Random(rnd).sample(range(n), n), dtype=np.int64)
            load = LoadJob(f"l{rnd}", 0, keys, hashes, targets, layerwise=False, kv=kv)
            expect = [kv_caches[name][int(ids[0])].clone() for name in list(kv_caches)[:2]] if rnd == 0 else None
            t_save = time_once(lambda: _run_job(transfers.submit_save, save, done))  # noqa: B023 - called now
            t_load = time_once(lambda: _run_job(transfers.submit_load, load, done))  # noqa: B023
            t_copy = time_once(lambda: np.copyto(dst, src))
            if rnd == 0:
                _check(kv_caches, expect, int(targets[0]), load)
                continue
            times["save"].append(t_save)
            times["load"].append(t_load)
            times["memcpy"].append(t_copy)
            store.remove(keys)  # the next round saves fresh blocks, as new prefills would
    finally:
        transfers.close()
        store.close()
    nbytes = n * kv.layout.nbytes
    base = gbps(nbytes, median(times["memcpy"]))
    fields = {"model": args.model, "tp": args.tp, "blocks": n, "block_bytes": kv.layout.nbytes}
    paths = {"save": save_path, "load": "from slots"}
    rows = [row({**fields, "op": op, "path": paths[op]}, gbps(nbytes, median(times[op])), base)
            for op in ("save", "load")]
    copies = "once" if save_path == "in place" else "twice"
    print_rows(rows, f"vLLM connector data path, {format_bytes(nbytes)} per round, {layers} layers, CPU KV",
               f"np.copyto of the same bytes; a save copies every byte {copies}, a load from DRAM once")
    write_json(rows, args.json)
    return 0


def _run_job(submit: Any, job: Any, done: dict[str, threading.Event]) -> None:
    done[job.req_id] = threading.Event()
    submit(job)
    if not done[job.req_id].wait(600):
        raise TimeoutError(f"bench job {job.req_id} did not finish")


def _check(kv_caches: dict[str, torch.Tensor], expect: list[torch.Tensor] | None, target: int, load: LoadJob) -> None:
    if load.failed:
        raise RuntimeError(f"bench: {len(load.failed)} blocks failed to load")
    for name, before in zip(kv_caches, expect or []):
        if not torch.equal(kv_caches[name][target], before):
            raise RuntimeError(f"bench: layer {name} of the loaded block differs from the saved one")
