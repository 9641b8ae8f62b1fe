"""The SGLang backend in each mode, against real daemons and real SGLang servers (its radix cache and controller,
tests/sglang_harness.py): standalone, a second server process finds the first one's pages in a real
kvtier-pool; distributed, a real kvtier-master places pages in a real kvtier-pool and another server's backend
finds them there. And every ``python -m sglang.launch_server`` command of README.md and docs/, parsed by SGLang's own
argument parser and extra-config reader and by kvtier's config.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_harness import SKIP_REASON, sglang_available

if not sglang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from masterproc import MasterProcess  # noqa: E402

from kvtier.client import MasterClient  # noqa: E402
from poolproc import PoolProcess, until  # noqa: E402
from sglang_harness import RadixServer, install  # noqa: E402

install()

SERVER = str(Path(__file__).parent / "sglang_server.py")
TOKENS = list(range(2000, 2000 + 9 * 4))  # 9 pages of 4 tokens


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def server_process(tmp: Path, op: str, kind: str, layout: str, extra: dict, name: str) -> dict:
    """tests/sglang_server.py as a process of its own: one SGLang server's write or read of TOKENS."""
    out = tmp / f"{name}.pt"
    job = {"op": op, "kind": kind, "layout": layout, "extra": extra, "tokens": TOKENS, "seed": 7, "out": str(out)}
    run = subprocess.run([sys.executable, SERVER, json.dumps(job)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["rows"] = torch.load(out)
    return result


def test_standalone_a_second_server_process_loads_the_first_ones_pages_from_the_node_pool(tmp_path):
    kind, layout = "mha", "layer_first"  # 2L segments per page (one segment: test_sglang_backend.py, standalone)
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity="8MiB") as pool:
        extra = {"mode": "standalone", "pool": pool.ipc, "pool_timeout_ms": 5000}
        a = RadixServer(kind=kind, layout=layout, extra=extra)
        try:
            ref = a.insert(TOKENS, seed=7)
            assert a.pump(a.backed_up)
            assert [t.name for t in a.backend.store.tiers] == ["pool"]  # the node pool is the store's DRAM
        finally:
            a.close()
        b = server_process(tmp_path, "read", kind, layout, extra, "b")  # another server, another process
        assert b["loaded"] == len(TOKENS)
        assert same(b["rows"], ref)
        assert b["stats"]["missed"] == 0 and b["stats"]["saved_in_place"] + b["stats"]["saved_staged"] == 0
        stranger = RadixServer(kind=kind, layout=layout, extra={**extra, "model": "other/model"})
        try:
            assert stranger.prefetch(TOKENS) == 0  # negative control: another model's namespace finds nothing
        finally:
            stranger.close()


def test_distributed_the_master_places_pages_in_a_pool_and_another_server_finds_them(tmp_path):
    with MasterProcess(tmp_path, lease_s=5.0) as master, \
            PoolProcess(tmp_path, master=master.endpoint, capacity="8MiB", block_bytes=768,
                        args=("--heartbeat-s", "0.2")):
        with MasterClient(master.endpoint) as m:
            assert until(lambda: any(n["state"] == "live" for n in m.nodes()))  # the pool can be placed on
        extra = {"mode": "distributed", "master": master.endpoint, "dram_capacity": "1MiB",
                 "pool_timeout_ms": 5000, "pool_staging_bytes": 0}
        a = RadixServer(kind="mha", layout="page_first", extra={**extra, "node_id": "gpu-a"})
        b = None
        try:
            ref = a.insert(TOKENS, seed=8)
            assert a.pump(a.backed_up)
            assert a.backend.store.flush(10)
            b = RadixServer(kind="mha", layout="page_first", extra={**extra, "node_id": "gpu-b"})
            keys = b.backend_keys(TOKENS)
            assert until(lambda: b.backend.batch_exists(keys) == 9)  # once the pool reported them to the master
            assert b.prefetch(TOKENS) == len(TOKENS)
            assert same(b.load_back(TOKENS), ref)
            assert b.backend.store.stats()["tiers"]["pool"]["hits"] == 9  # from the pool, not a's DRAM
        finally:
            a.close()
            if b is not None:
                b.close()


# ---- the documentation's commands (README.md and docs/*.md) ---------------------------------------------------


def readme_sglang_commands() -> list[list[str]]:
    """Every ``python -m sglang.launch_server ...`` command of the bash blocks of README.md and the docs pages
    (docs/sglang.md), each once, a paragraph each, its continuation lines joined as a shell joins them."""
    from doctext import commands

    return commands("python -m sglang.launch_server ", paragraphs=True)


def test_readme_sglang_commands_parse_with_sglangs_and_kvtiers_own_parsers():
    import argparse

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.server_args import ServerArgs

    from kvtier.connectors.sglang.settings import split_extra_config

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    modes = set()
    commands = readme_sglang_commands()
    assert commands
    for words in commands:
        args = parser.parse_args(words[3:])  # SystemExit on an unknown or malformed flag
        assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
        extra, *_ = HybridCacheController.parse_storage_backend_extra_config(args.hicache_storage_backend_extra_config)
        assert (extra["backend_name"], extra["module_path"], extra["class_name"], extra["interface_v1"]) == \
            ("kvtier", "kvtier.connectors.sglang", "KVTierHiCacheStorage", 1)
        _, interface_v1, config = split_extra_config(extra)  # unknown keys raise
        assert interface_v1
        modes.add(config.mode)
    assert modes == {"embedded", "standalone", "distributed"}
