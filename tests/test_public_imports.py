"""What users and tools import stays importable across moves (issue 28, item 7): vLLM's kv_connector_module_path,
SGLang's backend module and class, and the four names ../shared/peers/bench_peers.py imports (the store, the pool
launcher, connect, the pool bench and its raw-socket baseline). Each is imported in a fresh interpreter, as those
users do, so a re-export that only works after another module loaded it fails here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SGLANG_PYTHON = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"

IMPORTS = [
    ("kvtier.connectors.vllm", "KVTierConnector"),  # vLLM: kv_connector_module_path + kv_connector
    ("kvtier.connectors.sglang", "KVTierHiCacheStorage"),  # SGLang: module_path + class_name in the extra config
    ("kvtier.store", "TieredStore"),
    ("kvtier", "TieredStore"),
    ("kvtier.pool.process", "PoolDaemon"),
    ("kvtier.transport.dial", "connect"),
    ("kvtier.bench.pool", "_RawPeer"),
    ("kvtier.bench.pool", "bench_pool"),
    ("kvtier.keys", "Namespace"),
    ("kvtier.tools.cli", "main"),  # the kvtier command's entry point (pyproject.toml [project.scripts])
]


@pytest.mark.parametrize(("module", "name"), IMPORTS, ids=[f"{m}:{n}" for m, n in IMPORTS])
def test_a_public_import_path_resolves_in_a_fresh_interpreter(module: str, name: str) -> None:
    python = sys.executable
    code = f"import importlib; m = importlib.import_module({module!r}); getattr(m, {name!r})"
    if module == "kvtier.connectors.sglang":  # SGLang lives in a venv of its own (tests/run.sh)
        python = sys.executable if importlib.util.find_spec("sglang") else str(SGLANG_PYTHON)
        if not Path(python).exists():
            pytest.skip("the SGLang backend needs sglang: tests/run.sh installs it into .venv-sglang")
        # PyPI's torchvision cannot load beside the CPU torch; SGLang's HiCache path never uses it (sglang_harness.py)
        code = "from kvtier.bench.sglang import stub_missing_torchvision; stub_missing_torchvision(); " + code
    if module == "kvtier.connectors.vllm":
        pytest.importorskip("vllm", reason="the vLLM connector needs vllm")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"from {module} import {name} failed:\n{r.stderr[-3000:]}"


def test_python_dash_m_kvtier_runs_the_command() -> None:
    r = subprocess.run([sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: kvtier" in r.stdout, r.stderr[-2000:]
