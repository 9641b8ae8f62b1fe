"""A real kvtier-master subprocess for tests: start, wait until it serves, kill -9, SIGTERM, restart."""

from __future__ import annotations

import sys
from pathlib import Path

from daemonproc import DaemonProcess


class MasterProcess(DaemonProcess):
    """``python -m kvtier.master`` on a free port (kept across restarts), logging to ``tmp/master.log``."""

    what = "kvtier-master"

    def __init__(self, tmp: Path, *, data_dir: Path | None = None, lease_s: float = 1.0, args: tuple = (),
                 prefix: tuple = (), metrics_host: str | None = "127.0.0.1"):
        super().__init__(Path(tmp) / "master.log")
        self.tmp = Path(tmp)
        self.data_dir = data_dir
        self.lease_s = lease_s
        self.args = tuple(args)
        self.prefix = tuple(prefix)  # e.g. ("prlimit", "--nofile=1024:4096", "--"): what the daemon runs under
        self.metrics_host = metrics_host  # None: the daemon's default
        self.bind = "tcp://127.0.0.1:*"
        self.endpoint = ""
        self.metrics_port: int | None = None

    def start(self, timeout: float = 30.0) -> MasterProcess:
        cmd = [*self.prefix, sys.executable, "-m", "kvtier.master", "--bind", self.bind, "--metrics-port", "0",
               "--ready-file", str(self.tmp / "master.ready"), "--lease-s", str(self.lease_s), "--log-level", "info",
               *self.args]
        if self.metrics_host is not None:
            cmd += ["--metrics-host", self.metrics_host]
        if self.data_dir is not None:
            cmd += ["--data-dir", str(self.data_dir)]
        info = self._spawn(cmd, self.tmp / "master.ready", timeout)
        self.endpoint = info["endpoint"]
        self.metrics_port = info["metrics_port"]
        self.pid = info["pid"]
        self.bind = self.endpoint  # a restart comes back on the same endpoint
        return self

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
