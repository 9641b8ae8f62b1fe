"""DaemonProcess: a daemon subprocess that writes a JSON ready file once it serves (kvtier-master, kvtier-pool):
start and wait, read its log, kill -9, SIGTERM, SIGSTOP/SIGCONT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


class DaemonProcess:
    """Base of the test daemons; ``what`` names it in errors, its output goes to ``log_path``."""

    what = "daemon"

    def __init__(self, log_path: Path) -> None:
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def _spawn(self, cmd: list[str], ready: Path, timeout: float) -> dict[str, Any]:
        """Start ``cmd`` and wait for its ready file; its contents, or RuntimeError with the log."""
        ready.unlink(missing_ok=True)
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        log.close()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.what} not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        return json.loads(ready.read_text())

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

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until the process is stopped (a signal takes effect asynchronously)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline = time.monotonic() + timeout
        while stat.read_text().rpartition(")")[2].split()[0] != "T":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.what} did not stop within {timeout} s")
            time.sleep(0.005)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
