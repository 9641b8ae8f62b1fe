"""``kvtier bench <what>``: the benchmark subcommands."""

from __future__ import annotations

import argparse
import importlib

# name -> (module with add_arguments(parser) and run(args), help). Modules load only when chosen.
BENCHES = {
    "tiers": ("kvtier.bench.tiers", "batch put/get GB/s of a tier beside memcpy / raw I/O"),
    "kernels": ("kvtier.bench.kernels", "packed-block gather/scatter GB/s beside a contiguous copy"),
    "master": ("kvtier.bench.master", "kvtier-master lookup/cost latency beside a raw zmq echo; bytes per entry"),
    "vllm": ("kvtier.bench.vllm_connector", "vLLM connector save/load GB/s (gather+put, get+scatter) beside memcpy"),
    "ssd-eviction": ("kvtier.bench.ssd_eviction", "SSD eviction schemes on agentic-cc traces: hit rates, SSD writes "
                                                  "(a key-level study, no bytes move)"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks, each beside its physical baseline measured in the same run")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name, (module, help_text) in BENCHES.items():
        bp = bench_sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(bp)
        bp.set_defaults(func=lambda args, module=module: importlib.import_module(module).run(args))
