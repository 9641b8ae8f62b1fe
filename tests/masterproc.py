"""A real kvtier-master subprocess for tests: start, wait until it serves, kill -9, SIGTERM, restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class MasterProcess:
    """``python -m kvtier.master`` on a free port (kept across restarts), logging to ``tmp/master.log``."""

    def __init__(self, tmp: Path, *, data_dir: Path | None = None, lease_s: float = 1.0, args: tuple = ()):
        self.tmp = Path(tmp)
        self.data_dir = data_dir
        self.lease_s = lease_s
        self.args = tuple(args)
        self.bind = "tcp://127.0.0.1:*"
        self.endpoint = ""
        self.metrics_port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.tmp / "master.log"

    def start(self, timeout: float = 30.0) -> MasterProcess:
        ready = self.tmp / "master.ready"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kvtier.master", "--bind", self.bind, "--metrics-port", "0",
               "--metrics-host", "127.0.0.1", "--ready-file", str(ready), "--lease-s", str(self.lease_s),
               "--log-level", "info", *self.args]
        if self.data_dir is not None:
            cmd += ["--data-dir", str(self.data_dir)]
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        log.close()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier-master exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"kvtier-master not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        info = json.loads(ready.read_text())
        self.endpoint = info["endpoint"]
        self.metrics_port = info["metrics_port"]
        self.bind = self.endpoint  # a restart comes back on the same endpoint
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        """kill -9: no flush, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
