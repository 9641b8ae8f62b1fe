"""Real processes for pool tests: a kvtier-pool subprocess (start, wait until it serves, kill -9, SIGSTOP/SIGCONT,
restart) and an engine-like client process holding a TieredStore (tests/pool_client.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from daemonproc import DaemonProcess

BB = 32 << 10  # the client processes' block size
CLIENT = str(Path(__file__).parent / "pool_client.py")


class PoolProcess(DaemonProcess):
    """``python -m kvtier.pool`` bound to ``binds`` (tcp ports picked once and kept across restarts), logging
    to ``tmp/<name>.log``; its shared-memory file (standalone mode) lives in ``tmp``."""

    what = "kvtier-pool"

    def __init__(self, tmp: Path, *, tcp: bool = True, ipc: bool = False, capacity: str = "64MiB",
                 block_bytes: int = 0, master: str = "", lease_s: float = 30.0, name: str = "pool",
                 args: tuple = (), prefix: tuple = (), host: str = "127.0.0.1") -> None:
        super().__init__(Path(tmp) / f"{name}.log")
        self.tmp = Path(tmp)
        self.name = name
        self.binds = ([f"tcp://{host}:*"] if tcp else []) + ([f"ipc://{self.tmp}/{name}.sock"] if ipc else [])
        self.capacity, self.block_bytes, self.master, self.lease_s = capacity, block_bytes, master, lease_s
        self.args, self.prefix = tuple(args), tuple(prefix)
        self.endpoints: list[str] = []
        self.info: dict = {}

    @property
    def tcp(self) -> str:
        return next(e for e in self.endpoints if e.startswith("tcp://"))

    @property
    def ipc(self) -> str:
        return next(e for e in self.endpoints if e.startswith("ipc://"))

    def start(self, timeout: float = 30.0) -> PoolProcess:
        ready = self.tmp / f"{self.name}.ready"
        cmd = [*self.prefix, sys.executable, "-m", "kvtier.pool", "--capacity", self.capacity, "--shm-dir",
               str(self.tmp), "--ready-file", str(ready), "--lease-s", str(self.lease_s), "--log-level", "info",
               "--rdma", "off", *self.args]
        for b in self.binds:
            cmd += ["--bind", b]
        if self.block_bytes:
            cmd += ["--block-bytes", str(self.block_bytes)]
        if self.master:
            cmd += ["--master", self.master]
        self.info = self._spawn(cmd, ready, timeout)
        self.endpoints = self.info["endpoints"]
        self.binds = list(self.endpoints)  # a restart comes back on the same endpoints
        return self

    def __enter__(self) -> PoolProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
        self.kill()


class Client:
    """tests/pool_client.py as a subprocess: an engine-like process with a TieredStore."""

    def __init__(self, config: dict, log: Path, prefix: tuple = ()) -> None:
        self.log = open(log, "a")
        self.proc = subprocess.Popen([*prefix, sys.executable, CLIENT, json.dumps(config), str(BB)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.ask_raw() == {"ready": True}

    def ask_raw(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.ask_raw()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self.log.close()


def until(fn, timeout: float = 15.0, interval: float = 0.2):
    """fn() until it returns something truthy (or the timeout passes; then its last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_for(fn, timeout: float = 20.0, what: str = "condition", interval: float = 0.02):
    """fn()'s first truthy value; AssertionError naming ``what`` if the timeout passes first (``until`` returns
    the last value instead, for a test that asserts on it itself). Waits on a condition, never on a wall time."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def finishes(fn, timeout: float = 60.0):
    """fn()'s result (or its exception), run on a thread; AssertionError if it has not returned within the
    timeout. A guard against a hang, not a speed check: the timeout is far beyond any answer's."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout} s: a hang"
    if "error" in out:
        raise out["error"]
    return out["value"]
