"""``kvtier bench <what>``: the benchmark subcommands."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

# name -> (module with add_arguments(parser) and run(args), help). A module is imported only when its bench is
# chosen (its options are defined then, see _LazyBenchParser), so `kvtier --help` imports no torch.
BENCHES = {
    "tiers": ("kvtier.bench.tiers", "batch put/get GB/s of a tier beside memcpy / raw I/O"),
    "kernels": ("kvtier.bench.kernels", "packed-block gather/scatter GB/s beside a contiguous copy"),
    "master": ("kvtier.bench.master", "kvtier-master lookup/cost latency beside a raw zmq echo; bytes per entry"),
    "replication": ("kvtier.bench.replication", "hot-block replication between pools: hits kept through a pool's "
                                                "death and read load spread, beside replication off"),
    "vllm": ("kvtier.bench.vllm_connector", "vLLM connector save/load GB/s (gather+put, get+scatter) beside memcpy"),
    "sglang": ("kvtier.bench.sglang", "SGLang HiCache L3 backend set/get GB/s per host layout beside memcpy"),
    "engine": ("kvtier.bench.engine", "TTFT on a real vLLM CPU engine: cold vs kvtier-warm vs vLLM's own "
                                      "prefix-cache hit"),
    "dram-evict": ("kvtier.bench.dram_evict", "evicting DRAM puts beside memcpy; DRAM get latency while evictions "
                                              "write an SSD without staging, beside gets alone"),
    "policies": ("kvtier.bench.policies", "eviction policies' cost per key (observe, insert, victims) beside LRU's"),
    "soak": ("kvtier.bench.soak", "a master, two pools and N clients under mixed traffic (optionally killing "
                                  "daemons): errors, wrong bytes, p99 latency, daemon RSS over time"),
    "hybrid-bytes": ("kvtier.bench.hybrid_bytes", "bytes stored per prompt token for hybrid models: kvtier's "
                                                  "per-group objects beside every group whole, packed blocks and "
                                                  "vLLM's own retention (no bytes move)"),
    "ssd-eviction": ("kvtier.bench.ssd_eviction", "SSD eviction schemes on agentic-cc traces: hit rates, SSD writes "
                                                  "(a key-level study, no bytes move)"),
}


class _LazyBenchParser(argparse.ArgumentParser):
    """A bench's parser that imports its module and lets it add its options on first use: argparse parses a
    subcommand's arguments (and prints its --help) through ``parse_known_args``, only once it was chosen."""

    module = ""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        if self.module:
            module, self.module = self.module, ""
            importlib.import_module(module).add_arguments(self)
        return super().parse_known_args(args, namespace)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks, each beside its physical baseline measured in the same run")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}",
                                 parser_class=_LazyBenchParser)
    for name, (module, help_text) in BENCHES.items():
        bp = bench_sub.add_parser(name, help=help_text, description=help_text)
        bp.module = module
        bp.set_defaults(func=lambda args, module=module: importlib.import_module(module).run(args))
