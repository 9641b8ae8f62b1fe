"""The Mooncake Store rows of ``kvtier bench tiers --tier pool``: the peer measured in the same run, when installed.

Recipe: ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` plus
the distribution's libibverbs1 and ibverbs-providers. Two-process TCP as Mooncake's own docs set it up: a
``mooncake_master`` (with its HTTP metadata server), a ``mooncake_client`` process that holds the memory
segment, and this process as a client with no segment of its own, moving registered buffers with
``batch_put_from`` / ``batch_get_into`` (zero-copy calls, at most 64 MiB per call). Bytes are checked.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.common import gbps, median, row, time_once

CALL_BYTES = 64 << 20


def bench_mooncake(sizes: list[int], total: int, rounds: int, raw: dict[tuple[str, int], float]
                   ) -> tuple[list[dict[str, Any]], str | None]:
    """Rows for Mooncake (baseline: the raw socket of the same op and size), or none and why."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        return [], (f"Mooncake Store: not measured: the 'mooncake' package is not importable here ({e}); "
                    "install mooncake-transfer-engine-non-cuda to add its rows")
    tools = {name: _tool(name) for name in ("mooncake_master", "mooncake_client")}
    missing = [n for n, p in tools.items() if p is None]
    if missing:
        return [], f"Mooncake Store: not measured: {', '.join(missing)} not found next to {sys.executable} or on PATH"
    rpc, http, seg = _free_port(), _free_port(), _free_port()
    procs = [subprocess.Popen([tools["mooncake_master"], "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={http}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        _wait_port(rpc)
        _wait_port(http)
        segment_gb = -(-int(total * 1.5) // 10**9) + 1
        procs.append(subprocess.Popen([tools["mooncake_client"], "--host=127.0.0.1", f"--port={seg}",
                                       f"--global_segment_size={segment_gb} GB", "--local_buffer_size=0",
                                       "--protocol=tcp", f"--master_server_address=127.0.0.1:{rpc}",
                                       f"--metadata_server=http://127.0.0.1:{http}/metadata"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_port(seg)
        time.sleep(1.0)  # the segment registers with the master after the client's port opens
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", 0, 0, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            return [], f"Mooncake Store: not measured: setup failed with {rc}"
        try:
            rows: list[dict[str, Any]] = []
            for bb in sizes:
                rows += _bench_size(store, bb, max(1, total // bb), rounds, raw)
            return rows, None
        finally:
            store.close()
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _bench_size(store: Any, bb: int, n: int, rounds: int, raw: dict[tuple[str, int], float]) -> list[dict[str, Any]]:
    nbytes = n * bb
    src = torch.arange(nbytes, dtype=torch.int32).to(torch.uint8).view(n, bb)
    src[:, :8] = torch.arange(n, dtype=torch.int64).view(n, 1).view(torch.uint8)
    out = torch.empty_like(src)
    for t in (src, out):
        if store.register_buffer(t.data_ptr(), nbytes) != 0:
            raise RuntimeError("Mooncake register_buffer failed")
    per = max(1, CALL_BYTES // bb)
    times: dict[str, list[float]] = {"put": [], "get": []}
    for r in range(rounds + 1):
        keys = [f"kvtier-bench-{bb}-{r}-{i}" for i in range(n)]

        def move(fn: Any, t: torch.Tensor, what: str) -> None:
            for a in range(0, n, per):
                b = min(n, a + per)
                res = fn(keys[a:b], [t.data_ptr() + i * bb for i in range(a, b)], [bb] * (b - a))
                if any(x < 0 for x in res):
                    raise RuntimeError(f"Mooncake {what} failed at {bb} B blocks: {min(res)}")
        out.zero_()
        tp = time_once(lambda: move(store.batch_put_from, src, "batch_put_from"))
        tg = time_once(lambda: move(store.batch_get_into, out, "batch_get_into"))
        if not torch.equal(out, src):
            raise RuntimeError(f"Mooncake returned other bytes than were put at {bb} B blocks")
        store.batch_remove(keys, True)
        if r:
            times["put"].append(tp)
            times["get"].append(tg)
    for t in (src, out):
        store.unregister_buffer(t.data_ptr())
    return [row({"tier": "pool", "path": "mooncake", "op": op, "block_bytes": bb}, gbps(nbytes, median(v)),
                raw.get((op, bb), 0.0)) for op, v in times.items()]


def _tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Mooncake did not open port {port} within {timeout:g} s") from None
            time.sleep(0.1)
