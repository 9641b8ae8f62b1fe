"""``kvtier replay`` (real traces through a real store, against the offline optimum) and ``kvtier demo``."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import Config
from kvtier.memory.hostcopy import usable_cores
from kvtier.units import parse_bytes

if TYPE_CHECKING:
    from kvtier.tools.replay.sweep import RunPool

log = logging.getLogger(__name__)

# `kvtier demo`: the shipped sample (traces.sample_traces()), replayed on these settings, the default policy beside LRU.
# Eight of the ten sample traces, 8 lanes, HBM 5% of their unique blocks (an engine's HBM is small against the
# sessions it serves): first DRAM at 2%..25%, drawn as a PNG; then DRAM 10% without and with a second node's
# DRAM (a kvtier-pool process, 25%, as a victim cache) and an SSD tier (50%). About 70 s of CPU in all (each pool
# run starts a fresh kvtier-pool: ~2.5 s of it), so the 16 runs go to one worker process per CPU (--jobs).
DEMO_COMMON = ["--limit", "8", "--lanes", "8", "--hbm", "5%", "--policy", "default,lru"]
DEMO_CAPACITY_ARGS = [*DEMO_COMMON, "--dram", "2%,5%,10%,25%"]
DEMO_TIER_ARGS = [*DEMO_COMMON, "--dram", "10%", "--pool", "0,25%", "--ssd", "0,50%", "--set", "pool_offload=on_evict"]
DEMO_PLOT = "kvtier-demo.png"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="replay real traces through the store: hit rates per tier against the offline optimum",
        description="Replay agentic-cc traces (files or directories of *.json.gz) or one Mooncake JSONL trace "
                    "through an HBM prefix cache and a real TieredStore on a virtual clock; report hit rates per "
                    "tier, bytes moved, modeled TTFT, and the infinite-cache and Belady (OPT) limits.")
    p.add_argument("traces", nargs="+", help="trace files or directories")
    add_replay_arguments(p)
    p.set_defaults(func=run_replay)
    d = sub.add_parser("demo", help="replay the agentic-cc sample shipped with kvtier: the default policy beside "
                                    "LRU, tables and a hit-rate-vs-DRAM PNG",
                       description="`kvtier replay` on the sample of agentic-cc traces shipped inside the package "
                                   f"(Apache-2.0, see its NOTICE.md): with {' '.join(DEMO_CAPACITY_ARGS)} (plotted "
                                   f"to --plot, default ./{DEMO_PLOT}), then with {' '.join(DEMO_TIER_ARGS)}.")
    add_output_arguments(d, plot_default=DEMO_PLOT)
    d.add_argument("--model", help="the model whose blocks are replayed (default llama-3.1-8b); a hybrid one "
                                   "(gemma-3-27b, qwen3-next-80b-a3b, deepseek-v4-flash) adds its bytes per group")
    add_jobs_argument(d, default=usable_cores())
    d.set_defaults(func=run_demo)


def add_jobs_argument(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--jobs", type=int, default=default, metavar="N",
                   help=f"replay the sweep's runs in N worker processes, each run on its own (default {default}; "
                        "1: one after another in this process)")


def add_output_arguments(p: argparse.ArgumentParser, plot_default: str | None = None) -> None:
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=plot_default,
                   help="draw hit rate against DRAM capacity per policy, with OPT and the infinite cache"
                        + (f" (default {plot_default})" if plot_default else ""))
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.tools.replay.replayer import OFFLOAD_MODES
    from kvtier.tools.replay.service import DEFAULT_DECODE_TOKENS_PER_S, DEFAULT_PREFILL_TOKENS_PER_S

    g = p.add_argument_group("traces")
    g.add_argument("--format", choices=("agentic", "mooncake"), help="trace format (default: from file names)")
    g.add_argument("--limit", type=int, metavar="N", help="the first N trace files by name (standard slice: 60)")
    g.add_argument("--lanes", type=int, default=32, help="concurrent conversations (agentic-cc; default 32)")
    g.add_argument("--seed", type=int, default=0, help="order in which lanes take traces (default 0)")
    g.add_argument("--repeat", type=int, default=1, help="replays of each trace, each with its own salt")
    g.add_argument("--think-cap", type=float, default=60.0, metavar="S", help="cap on think times (default 60 s)")
    g = p.add_argument_group("sizing")
    g.add_argument("--model", help="llama-3.1-8b (default), qwen3-32b, deepseek-v3, ... (see kvtier.layout.MODELS); "
                                   "hybrid: gemma-3-27b, qwen3-next-80b-a3b, deepseek-v4-flash "
                                   "(kvtier.tools.replay.hybrid)")
    g.add_argument("--store-groups", choices=("useful", "whole"), default="useful",
                   help="a hybrid model: store only what can be used (full-history blocks, state and window tails "
                        "at checkpoints; default) or every group of every block whole")
    g.add_argument("--checkpoint-interval", type=int, metavar="TOKENS",
                   help="a hybrid model: the engine also keeps a checkpoint every TOKENS tokens (a multiple of the "
                        "block size; default 0, vLLM's: the end of each prompt and fork junctions only)")
    g.add_argument("--layers", type=int, help="explicit model: layers (with --kv-heads, --head-dim)")
    g.add_argument("--kv-heads", type=int, help="explicit model: KV heads")
    g.add_argument("--head-dim", type=int, help="explicit model: head dim")
    g.add_argument("--dtype", default="bfloat16", help="KV dtype (default bfloat16)")
    g.add_argument("--hbm", default="40GiB", help="HBM for the engine's prefix cache: bytes or %% of unique blocks")
    g.add_argument("--dram", default="200GiB", help="DRAM tier: bytes or %% of the replayed traces' unique blocks; "
                                                   "a comma list sweeps (e.g. 2%%,5%%,10%%,25%%); 0: HBM only")
    g.add_argument("--pool", help="a second node's DRAM under this one's (a fresh kvtier-pool process per run, "
                                  "evicting by the run's policy, over loopback TCP): bytes or %% of unique blocks, "
                                  "a comma list sweeps; --set pool_offload=on_evict makes it a victim cache "
                                  "(default write_through, the store's default)")
    g.add_argument("--ssd", help="SSD tier under DRAM: bytes or %% of unique blocks, a comma list sweeps; its files "
                                 "go to a fresh directory under --set ssd_path=DIR (default: the temp dir)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another store config key; *_capacity keys take bytes, %% or a comma list like --dram")
    g = p.add_argument_group("store and server")
    g.add_argument("--policy", default="default,lru",
                   help="eviction policies, comma-separated: default (the session-aware pnu), lru, fifo, s3fifo, arc, "
                        "chain-lru, or an import path (default: default,lru)")
    g.add_argument("--sessions", action="store_true",
                   help="the harness sends each agent's session id with its requests (default: none; the store "
                        "infers agents from the chains)")
    g.add_argument("--hints", action="store_true",
                   help="the harness also says when an agent is finished and when it waits on subagents")
    g.add_argument("--prefetch", default="on", metavar="on|off|on,off",
                   help="prefetch between turns: the store brings idle agents' prefixes up into DRAM before they "
                        "are predicted back, at the lower tiers' bandwidth left by demand loads (default on; "
                        "on,off runs each policy both ways, named POLICY+pf and POLICY-pf)")
    g.add_argument("--offload", choices=OFFLOAD_MODES, default="write-through",
                   help="write-through: computed blocks are stored at once; write-back: when HBM evicts them")
    g.add_argument("--prefill-rate", type=float, default=DEFAULT_PREFILL_TOKENS_PER_S, metavar="TOK/S",
                   help=f"prefill tokens/s (default {DEFAULT_PREFILL_TOKENS_PER_S:g}: an 8B model on one H200)")
    g.add_argument("--decode-rate", type=float, default=DEFAULT_DECODE_TOKENS_PER_S, metavar="TOK/S",
                   help=f"decode tokens/s per request (default {DEFAULT_DECODE_TOKENS_PER_S:g})")
    g.add_argument("--bandwidth", action="append", default=[], metavar="TIER=BYTES",
                   help="load bandwidth per second from a tier, e.g. dram=50GB (defaults: dram 50 GB/s, "
                        "pool 25 GB/s, ssd 6 GB/s)")
    add_output_arguments(p)
    add_jobs_argument(p, default=1)


def run_replay(args: argparse.Namespace, title: str = "kvtier replay") -> int:
    with _run_pool(args.jobs) as pool:
        report = replay(args, title, pool)
    if args.json:
        from kvtier.bench.common import write_json

        write_json(report, args.json)
    return 0


def replay(args: argparse.Namespace, title: str = "kvtier replay", pool: RunPool | None = None) -> dict[str, Any]:
    """Run the sweep ``args`` describe (its runs on ``pool``'s workers if given): print the table, draw
    ``args.plot``; return the JSON report."""
    from kvtier.tools.replay.plot import plot_hit_rates, require_matplotlib
    from kvtier.tools.replay.replayer import ReplayConfig
    from kvtier.tools.replay.report import print_table, to_json
    from kvtier.tools.replay.service import DEFAULT_TIER_BYTES_PER_S, ServiceModel
    from kvtier.tools.replay.sizing import model_layout, parse_capacities, parse_capacity
    from kvtier.tools.replay.sweep import Sweep, capacity_keys
    from kvtier.tools.replay.workload import load_workload

    if args.plot:
        require_matplotlib()
    tiers, extra = _tier_grid(args.dram, args.set, capacity_keys(), parse_capacities)
    if args.pool:
        if "pool_capacity" in tiers:
            raise ValueError("give the pool size once: --pool or --set pool_capacity")
        tiers["pool_capacity"] = parse_capacities(args.pool)
    if args.ssd:
        if "ssd_capacity" in tiers:
            raise ValueError("give the SSD size once: --ssd or --set ssd_capacity")
        tiers["ssd_capacity"] = parse_capacities(args.ssd)
        extra.setdefault("ssd_path", str(Path(tempfile.gettempdir()) / "kvtier-replay"))
    bandwidth = dict(DEFAULT_TIER_BYTES_PER_S)
    for item in args.bandwidth:
        tier, value = _key_value(item, "--bandwidth")
        bandwidth[tier] = float(parse_bytes(value.removesuffix("/s")))
    service = ServiceModel(args.prefill_rate, args.decode_rate, bandwidth)
    prefetch = _switches(args.prefetch, "--prefetch")
    config = ReplayConfig(lanes=args.lanes, think_cap_s=args.think_cap, offload=args.offload,
                          sessions=args.sessions, hints=args.hints, prefetch=prefetch[0])
    hbm = parse_capacity(args.hbm)
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]

    t0 = time.process_time()
    files = _bar(args, "reading traces", None, unit="file")
    workload = load_workload(args.traces, args.format, args.limit, args.repeat, args.seed,
                             on_file=(lambda _: files.update(1)) if files is not None else None)
    if files is not None:
        files.close()
    parse_s = time.process_time() - t0
    sizing = model_layout(args.model, workload.block_tokens, layers=args.layers, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, dtype=args.dtype, checkpoint_interval=args.checkpoint_interval)
    name, layout, hybrid = sizing
    if hybrid is not None and args.store_groups == "whole":  # one packed block per block: the uniform replay
        name, hybrid = f"{name} (every group whole)", None
    sweep = Sweep(workload, layout, name, hbm, tiers, policies, service, config, extra,
                  progress=lambda desc, total: _bar(args, desc, total, unit="req"), hybrid=hybrid,
                  share_bytes=sizing.share_bytes, prefetch=prefetch)
    points = sweep.run(pool)
    print_table(sweep, points, title)
    cpu = sum(r.result.cpu_s for p in points for r in p.runs.values())
    opt = sum(r.opt_cpu_s for p in points for r in p.runs.values())
    reqs = sum(r.result.requests for p in points for r in p.runs.values())
    print(f"CPU: traces read in {parse_s:.1f} s once; {reqs:,} requests replayed in {cpu:.1f} s "
          f"({reqs / cpu if cpu else 0:,.0f} requests per CPU-second); limits (OPT, infinite) {opt:.1f} s")
    report = to_json(sweep, points)
    report["cpu"] = {"parse_s": parse_s, "replay_s": cpu, "limits_s": opt}
    if args.plot:
        plot_hit_rates(points, sweep.unit_bytes, args.plot, f"{title}: {workload.short()}\n{name}, "
                       + (f"{args.lanes} lanes" if not workload.timed else "timed arrivals"))
    return report


def run_demo(args: argparse.Namespace) -> int:
    """Two replays of the shipped sample: DRAM capacities (plotted), then DRAM with a pool and an SSD under it.
    ``--json`` gets the first report with the second under ``"tiers"``."""
    from kvtier.tools.replay.traces import sample_traces

    sample = sample_traces()
    if not sample.is_dir():
        raise OSError(f"the demo traces are missing from this install ({sample}); reinstall kvtier")
    parser = argparse.ArgumentParser(prog="kvtier demo")
    parser.add_argument("traces", nargs="+")
    add_replay_arguments(parser)
    passed = ["--no-progress"] if args.no_progress else []
    passed += ["--model", args.model] if args.model else []
    plot = ["--plot", str(args.plot)] if args.plot else []
    print(f"kvtier demo = kvtier replay <sample> {' '.join(DEMO_CAPACITY_ARGS)}  (sample: {sample})")
    with _run_pool(args.jobs) as pool:  # one set of workers for both sweeps
        report = replay(parser.parse_args([str(sample), *DEMO_CAPACITY_ARGS, *plot, *passed]),
                        title="kvtier demo, DRAM capacity", pool=pool)
        if args.plot:
            print(f"  {args.plot}: hit rate (share of input tokens served from HBM or the store) against DRAM "
                  "capacity, one line per policy, with Belady's optimum for HBM + DRAM and for DRAM alone, and "
                  "the infinite cache")
        print(f"\nkvtier demo = kvtier replay <sample> {' '.join(DEMO_TIER_ARGS)}")
        report["tiers"] = replay(parser.parse_args([str(sample), *DEMO_TIER_ARGS, *passed]),
                                 title="kvtier demo, tiers under DRAM", pool=pool)
    if args.json:
        from kvtier.bench.common import write_json

        write_json(report, args.json)
    return 0


@contextmanager
def _run_pool(jobs: int) -> Iterator[RunPool | None]:
    from kvtier.tools.replay.sweep import run_pool

    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    pool = run_pool(jobs)
    try:
        yield pool
    finally:
        if pool is not None:
            pool.close()


def _tier_grid(dram: str, settings: list[str], known: list[str], parse: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """--dram and --set KEY=VALUE -> ({capacity key: [Capacity]}, {other config key: value})."""
    tiers: dict[str, Any] = {"dram_capacity": parse(dram)}
    extra: dict[str, Any] = {}
    config_keys = {f for f, _, _ in Config.describe()}
    for item in settings:
        key, value = _key_value(item, "--set")
        if key == "dram_capacity":
            raise ValueError("--set dram_capacity: use --dram")
        if key == "eviction":
            raise ValueError("--set eviction: use --policy")
        if key in known:
            tiers[key] = parse(value)
        elif key in config_keys:
            extra[key] = value
        else:
            Config.from_dict({key: value})  # raises ConfigError naming the key and the closest known ones
    return tiers, extra


def _switches(text: str, flag: str) -> list[bool]:
    """'on', 'off' or a comma list of them -> [True/False, ...]."""
    out = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        if item not in ("on", "off"):
            raise ValueError(f"{flag} {text!r}: expected on, off or on,off")
        out.append(item == "on")
    if not out:
        raise ValueError(f"{flag} {text!r}: expected on, off or on,off")
    return out


def _key_value(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
    return key.strip(), value.strip()


def _bar(args: argparse.Namespace, desc: str, total: int | None, unit: str) -> Any:
    if args.no_progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, mininterval=0.5, file=sys.stderr)
