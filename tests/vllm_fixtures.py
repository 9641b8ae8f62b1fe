"""The vLLM connector tests' fixtures (a pytest plugin, listed in tests/conftest.py's ``pytest_plugins``):
``model`` (a tiny model directory, one per module), ``ipc_dir`` (a short socket directory) and ``engine``
(``engine(tp=1, **extra)``: an Engine of tests/vllm_engine.py, closed at the test's end). A test asks for them
by argument name; nothing imports them. vllm_engine (and vLLM) is imported only when a test uses one, so the
suite collects on a machine without vLLM.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vllm_engine import tiny_model

    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short directory for the lookup sockets (a Unix socket path has at most 107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvt", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine(model: str, ipc_dir: str) -> Iterator[Callable[..., Any]]:
    """``engine(tp=1, **extra)``: an Engine whose kv_connector_extra_config is a small DRAM plus ``extra``
    (closed at the end of the test, or earlier by the test)."""
    from vllm_engine import Engine, vllm_config

    engines: list[Engine] = []

    def make(tp: int = 1, events: bool = False, kv_layout: str = "LBNHC", num_blocks: int = 64,
             kv_role: str = "kv_both", **extra: Any) -> Engine:
        config = vllm_config(model, {"dram_capacity": "4MiB", "staging_bytes": "64KiB", "ipc_dir": ipc_dir,
                                     **extra}, tp=tp, events=events, kv_layout=kv_layout, kv_role=kv_role)
        eng = Engine(config, tp=tp, num_blocks=num_blocks)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()
