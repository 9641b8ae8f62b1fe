"""PoolDaemon: a kvtier-pool subprocess on this machine, for tools that need a second node's DRAM here (the
pool benchmark, ``kvtier replay --pool``). Starts it, waits until it serves, stops it (SIGTERM) on exit.

    with PoolDaemon(capacity=1 << 30, block_bytes=65536, ipc=True, eviction="s3fifo") as pool:
        pool.endpoint("tcp"), pool.endpoint("ipc")

Runs in the caller's process; not thread-safe (one owner). Its ready file, ipc socket and keys live in a
temporary directory; the pool's DRAM file (``--shm-dir``, with an ipc endpoint) lives in a directory of its own
under /dev/shm, memory as a user would run it, not the temp dir, which is a disk on many hosts (a pool in a
disk file pays for page-cache writeback on every put). Where /dev/shm does not exist it falls back to the
temporary directory and logs so. Both directories are unique per daemon (``mkdtemp``) and removed on exit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.auth import ClientKeys, generate

log = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"  # where the pool's DRAM file goes: memory (a tmpfs) on Linux


class PoolDaemon:
    """``python -m kvtier.pool`` bound on loopback tcp (and an ipc socket with ``ipc``), sized to ``capacity``,
    evicting by ``eviction`` (a policy name the pool process knows: a built-in one). With ``auth`` it requires
    CurveZMQ keys, made fresh in its temporary directory; ``client_auth(endpoint)`` gives a client's."""

    def __init__(self, capacity: int, block_bytes: int, *, ipc: bool = False, workers: int = 2,
                 eviction: str = "lru", log_level: str = "warning", start_timeout_s: float = 60.0,
                 auth: bool = False, policy_clock: str = "local") -> None:
        self.capacity, self.block_bytes, self.ipc, self.workers = capacity, block_bytes, ipc, workers
        self.auth = auth
        self.eviction = eviction
        self.policy_clock = policy_clock  # "sender": the policy reads the observations' (a replay's virtual) time
        self.log_level, self.start_timeout_s = log_level, start_timeout_s
        self.endpoints: list[str] = []
        self._dir: Path | None = None
        self.shm_dir: Path | None = None  # the directory of the pool's DRAM file, while it runs
        self._proc: subprocess.Popen[bytes] | None = None

    def endpoint(self, scheme: str) -> str:
        """The bound endpoint of ``scheme`` ("tcp" or "ipc")."""
        for e in self.endpoints:
            if e.startswith(scheme + "://"):
                return e
        raise ValueError(f"the pool serves no {scheme} endpoint (it serves {', '.join(self.endpoints)})")

    def __enter__(self) -> PoolDaemon:
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-pool-"))
        self.shm_dir = _shm_dir(self._dir)
        ready = self._dir / "ready"
        cmd = [sys.executable, "-m", "kvtier.pool", "--bind", "tcp://127.0.0.1:*", "--capacity", str(self.capacity),
               "--block-bytes", str(self.block_bytes), "--shm-dir", str(self.shm_dir), "--ready-file", str(ready),
               "--rdma", "off", "--workers", str(self.workers), "--eviction", self.eviction,
               "--policy-clock", self.policy_clock,
               "--log-level", self.log_level, "--client-share", "1"]  # one client: this tool
        if self.ipc:
            cmd += ["--bind", f"ipc://{self._dir}/pool.sock"]
        if self.auth:
            cmd += ["--auth-dir", str(_make_keys(self._dir))]
        self._proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not ready.exists():
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvtier-pool did not start (exit code {self._proc.poll()}; command: "
                                       f"{' '.join(cmd)})")
                time.sleep(0.02)
            self.endpoints = json.loads(ready.read_text())["endpoints"]
        except BaseException:  # a Ctrl-C while it starts too: no `with` will call __exit__ for a failed __enter__
            self.__exit__()
            raise
        return self

    def client_auth(self, endpoint: str) -> ClientKeys | None:
        """The keys a client presents to this pool (None without ``auth``)."""
        if not self.auth or self._dir is None:
            return None
        return ClientKeys.load(self._dir / "client", endpoint)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        for d in (self.shm_dir, self._dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self.shm_dir = self._dir = None


def _shm_dir(fallback: Path) -> Path:
    """A fresh directory under SHM_ROOT for the pool's DRAM file; ``fallback`` (logged) where there is none."""
    if os.path.isdir(SHM_ROOT):
        return Path(tempfile.mkdtemp(prefix=f"kvtier-pool-{os.getpid()}-", dir=SHM_ROOT))
    log.warning("%s does not exist here: the pool's DRAM file goes to %s (a disk on many hosts: slower copies)",
                SHM_ROOT, fallback)
    return fallback


def _make_keys(directory: Path) -> Path:
    """A daemon keypair admitting one client keypair (docs/pool.md "Authenticated sockets"); the daemon's dir."""
    daemon, client = directory / "daemon", directory / "client"
    generate(daemon, "server", role="daemon")
    generate(client, role="engine")
    (daemon / "authorized" / "engines").mkdir(parents=True)
    shutil.copy(client / "client.key", daemon / "authorized" / "engines" / "client.key")
    shutil.copy(daemon / "server.key", client / "server.key")
    return daemon
