"""``kvtier bench kernels``: packed-block gather/scatter GB/s beside a contiguous copy of the same bytes.

The engine KV is allocated the way the chosen engine does it (vLLM 0.33 pages by default) for a known model;
each round gathers N engine blocks in a shuffled order into N packed blocks and scatters them back. Baselines,
measured in the same rounds so machine noise hits both alike (medians, after one warm-up round that also
checks the bytes against the torch backend):
- CPU: ``np.copyto`` of the same bytes, one contiguous memcpy.
- GPU (when torch sees one): device-to-device ops against one contiguous ``copy_`` on the device;
  device-to-host gathers into pinned packed rows and host-to-device scatters against one contiguous
  async copy between device and pinned memory. The cuda backend's staged host path (kernel into device
  scratch, then one async copy per chunk) is measured beside its direct mapped-memory path.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier import kernels
from kvtier.bench.common import gbps, median, print_rows, row, time_once, write_json
from kvtier.kernels import dispatch
from kvtier.layout import MODELS, BlockLayout
from kvtier.units import parse_bytes

ENGINES = ("vllm", "vllm-legacy", "flashinfer", "sglang")


def make_engine(engine: str, model: str, block_size: int, num_blocks: int, device: str) -> kernels.EngineKV:
    """A model's KV cache as ``engine`` allocates it, filled with a byte pattern, and its EngineKV."""
    spec = MODELS[model]
    layers, heads, dim = spec["num_layers"], spec["num_kv_heads"], spec["head_dim"]
    layout = BlockLayout.mha(layers, heads, dim, "bfloat16", block_size, kv_fused=engine == "vllm")

    def alloc(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).copy_(torch.arange(t.numel(), device=device, dtype=torch.int32).view(shape))
        return t

    if engine == "vllm":  # LBNHC: per layer (B, N, H, 2D) physical, (B, H, N, 2D) logical
        sources = kernels.vllm_sources(layout, [alloc(num_blocks, block_size, heads, 2 * dim).transpose(1, 2)
                                                for _ in range(layers)])
    elif engine == "vllm-legacy":
        sources = kernels.vllm_legacy_sources(layout, [alloc(2, num_blocks, block_size, heads, dim)
                                                       for _ in range(layers)])
    elif engine == "flashinfer":
        sources = kernels.flashinfer_sources(layout, [alloc(num_blocks, 2, block_size, heads, dim)
                                                      for _ in range(layers)])
    elif engine == "sglang":
        tokens = num_blocks * block_size
        sources = kernels.sglang_sources(layout, [alloc(tokens, heads, dim) for _ in range(layers)],
                                         [alloc(tokens, heads, dim) for _ in range(layers)])
    else:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return kernels.EngineKV(layout, sources)


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    if device == "cpu":
        return time_once

    def timed(fn: Callable[[], Any]) -> float:
        torch.cuda.synchronize()
        return time_once(lambda: (fn(), torch.cuda.synchronize()))

    return timed


def _measure(ops: dict[str, Callable[[], Any]], rounds: int, device: str) -> dict[str, float]:
    """Median seconds per op over ``rounds`` rounds, ops interleaved within each round; round 0 warms up."""
    timed = _timer(device)
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds + 1):
        for name, fn in ops.items():
            t = timed(fn)
            if r:
                times[name].append(t)
    return {name: median(ts) for name, ts in times.items()}


def _check(kv: kernels.EngineKV, ids: list[int], packed: torch.Tensor, backend: str) -> None:
    want = torch.zeros(len(ids), kv.block_bytes, dtype=torch.uint8, device=kv.device)
    kernels.gather(kv, ids, want, backend="torch")
    if not torch.equal(packed.to(kv.device), want):
        raise RuntimeError(f"kernel bench: the {backend} backend gathered different bytes than the torch backend")


def bench_cpu(kv: kernels.EngineKV, ids: list[int], backends: list[str], rounds: int, threads: int
              ) -> list[dict[str, Any]]:
    n, bb = len(ids), kv.block_bytes
    packed = torch.zeros(n, bb, dtype=torch.uint8)
    src, dst = np.ones(n * bb, np.uint8), np.zeros(n * bb, np.uint8)
    rows = []
    for be in backends:
        kernels.gather(kv, ids, packed, backend=be, threads=threads)
        _check(kv, ids, packed, be)
        t = _measure({
            "memcpy": lambda: np.copyto(dst, src),
            "gather": lambda be=be: kernels.gather(kv, ids, packed, backend=be, threads=threads),
            "scatter": lambda be=be: kernels.scatter(kv, ids, packed, backend=be, threads=threads),
        }, rounds, "cpu")
        base = gbps(n * bb, t["memcpy"])
        for op in ("gather", "scatter"):
            rows.append(row({"backend": be, "op": op, "block_bytes": bb}, gbps(n * bb, t[op]), base))
    return rows


def bench_gpu(kv: kernels.EngineKV, ids: list[int], backends: list[str], rounds: int) -> list[dict[str, Any]]:
    n, bb = len(ids), kv.block_bytes
    dev = torch.empty(n, bb, dtype=torch.uint8, device=kv.device)
    host = torch.empty(n, bb, dtype=torch.uint8, pin_memory=True)
    a, b = torch.empty_like(dev), torch.empty_like(dev)
    rows = []
    for be in backends:
        kernels.gather(kv, ids, dev, backend=be)
        kernels.gather(kv, ids, host, backend=be)
        torch.cuda.synchronize()
        _check(kv, ids, dev, be)
        _check(kv, ids, host, be)
        ops: dict[str, Callable[[], Any]] = {
            "copy_d2d": lambda: a.copy_(b),
            "copy_d2h": lambda: host.copy_(dev, non_blocking=True),
            "copy_h2d": lambda: dev.copy_(host, non_blocking=True),
            "gather_d2d": lambda be=be: kernels.gather(kv, ids, dev, backend=be),
            "scatter_d2d": lambda be=be: kernels.scatter(kv, ids, dev, backend=be),
            "gather_d2h": lambda be=be: kernels.gather(kv, ids, host, backend=be),
            "scatter_h2d": lambda be=be: kernels.scatter(kv, ids, host, backend=be),
        }
        if be == "cuda":  # is writing pinned memory from the kernel better than a staging copy? measure both
            cuda_be = dispatch.backend("cuda")
            g_ids = dispatch.block_id_table(kv, ids, False)
            s_ids = dispatch.block_id_table(kv, ids, True)
            host_rows = dispatch.packed_rows(host, n, bb, "host")
            ops["gather_d2h_staged"] = lambda: dispatch._staged(cuda_be, kv, g_ids, host_rows, False, 1)
            ops["scatter_h2d_staged"] = lambda: dispatch._staged(cuda_be, kv, s_ids, host_rows, True, 1)
        t = _measure(ops, rounds, "cuda")
        for op in [o for o in ops if not o.startswith("copy_")]:
            base = t["copy_d2d" if op.endswith("d2d") else "copy_d2h" if "d2h" in op else "copy_h2d"]
            rows.append(row({"backend": be, "op": op, "block_bytes": bb}, gbps(n * bb, t[op]), gbps(n * bb, base)))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="vllm",
                   help="engine KV layout (vllm = 0.33 pages into fused kv parts; others into k/v parts)")
    p.add_argument("--model", default="llama-3.1-8b", help=f"model dimensions (known: {', '.join(MODELS)})")
    p.add_argument("--block-sizes", default="16,64", help="tokens per block, comma-separated (default 16,64)")
    p.add_argument("--total", default="512MiB", help="bytes moved per op and round on the CPU (default 512MiB)")
    p.add_argument("--gpu-total", default="2GiB", help="bytes moved per op and round on a GPU (default 2GiB)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds; medians are reported")
    p.add_argument("--threads", type=int, default=1, help="threads for the cpu backend")
    p.add_argument("--backends", default="auto",
                   help="comma-separated backends to measure (default: every one that runs compiled here)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    if args.model.lower() not in MODELS:
        raise ValueError(f"unknown model {args.model!r}; known: {', '.join(MODELS)}")
    if "kv_lora_rank" in MODELS[args.model.lower()]:
        raise ValueError(f"{args.model} is an MLA model; the kernel bench measures MHA layouts")
    rows: list[dict[str, Any]] = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        total = parse_bytes(args.gpu_total if device == "cuda" else args.total)
        for block_size in (int(s) for s in args.block_sizes.split(",") if s.strip()):
            n = max(1, total // _layout_bytes(args.model, block_size))
            kv = make_engine(args.engine, args.model.lower(), block_size, n, device)
            ids = list(range(n))
            random.Random(block_size).shuffle(ids)
            backends = _backends(kv, args.backends)
            if device == "cpu":
                rows += bench_cpu(kv, ids, backends, args.rounds, args.threads)
            else:
                rows += bench_gpu(kv, ids, backends, args.rounds)
            del kv
    print_rows(rows, f"kvtier bench kernels --engine {args.engine} --model {args.model}",
               "memcpy of the same bytes (CPU: np.copyto; GPU: one contiguous copy_ d2d / d2h / h2d)")
    write_json(rows, args.json)
    return 0


def _layout_bytes(model: str, block_size: int) -> int:
    spec = MODELS[model.lower()]
    return BlockLayout.mha(spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], "bf16", block_size).nbytes


def _backends(kv: kernels.EngineKV, wanted: str) -> list[str]:
    status = kernels.backend_status(kv)
    if wanted != "auto":
        names = [b.strip() for b in wanted.split(",") if b.strip()]
        for b in names:
            if b not in status:
                raise ValueError(f"unknown backend {b!r}; known: {', '.join(status)}")
            if status[b]:
                raise ValueError(f"backend {b} cannot run here: {status[b]}")
        return names
    usable = [b for b, reason in status.items() if reason is None]
    if kv.device.type == "cpu":  # the Triton interpreter is a test tool, not something to time
        usable = [b for b in usable if b != "triton"]
    return usable
