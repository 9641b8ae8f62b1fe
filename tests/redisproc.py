"""A real redis-server for tests (Debian's redis-server package, which tests/run.sh installs): its own directory,
a free port on 127.0.0.1, kill -9 and restart on the same port, with or without its data."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None or not __import__("importlib").util.find_spec("redis"),
                                 reason="needs Debian's redis-server and the redis package (tests/run.sh installs "
                                        "both: apt-get install redis-server; pip install 'kvtier[redis]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """``redis-server`` in ``tmp/redis-<name>``; ``persist`` keeps an append-only file (fsync always), so a kill -9
    loses nothing; without it a restart comes back empty (Redis that lost its data)."""

    def __init__(self, tmp: Path, persist: bool = True, name: str = "r") -> None:
        self.dir = Path(tmp) / f"redis-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisProcess:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        if not self.persist:
            for f in self.dir.glob("*"):
                if f.is_file() and f.name != "redis.log":
                    f.unlink()
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on {self.port}: "
                                   f"{(self.dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
