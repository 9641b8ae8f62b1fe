"""``kvtier bench tiers --tier pool``: batch put/get GB/s between this process and a kvtier-pool process.

Per block size, one pool subprocess (bound on tcp and ipc) and one raw-socket peer subprocess; each round, in
this order so machine noise hits all alike:

  raw put / raw get      the same bytes over one plain TCP socket between two processes (sendall of the whole
                         batch, recv_into a preallocated buffer): the physical baseline of the TCP rows
  pool stream put / get  StreamConnection: raw TCP data sockets received straight into place, parallel
                         connections, zmq control (kvtier.transport.stream; what transport "auto" picks)
  pool tcp put / get     TcpConnection: block bytes in zmq frames, parallel connections (kvtier.transport.tcp)
  copy: ...              the best copy this host can do, of the same bytes: np.copyto, np.copyto on two threads,
                         kvtier's copy_rows on one and on two threads (bench/copies.py); the fastest is the
                         baseline of the shm rows
  pool shm put / get     standalone mode: copies into and out of the pool's mapped file (kvtier.transport.shm),
                         threads by measured rate (pool_copy_threads 0, the default)
  pool shm-1thread       the same on one copy thread (pool_copy_threads 1): the default's before/after
  Mooncake put / get     Mooncake Store over TCP, segment in another process (bench/pool_mooncake.py), when
                         the ``mooncake`` package is importable; skipped with a note otherwise

With ``--pool-auth`` each size runs again against a pool started with --auth-dir (fresh keys): rows
``stream+auth``, ``tcp+auth`` (CurveZMQ-encrypted frames), ``shm+auth``, each beside its own run's baseline.

Every get is checked byte for byte against what was put; keys are fresh each round and removed after it.
Round 0 warms up (page faults, connections); figures are medians of the other rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import numpy as np
import torch

from kvtier.bench.common import gbps, median, row, time_once
from kvtier.bench.copies import HostCopies
from kvtier.keys import Namespace
from kvtier.pool.process import PoolDaemon
from kvtier.transport import connect

DEFAULT_SIZES = "64KiB,1MiB,4MiB"
OPS = ("put", "get")


def bench_pool(sizes: list[int], total: int, rounds: int, *, connections: int = 4, mooncake: bool = True,
               pool_auth: bool = False, **_: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for bb in sizes:
        rows += _bench_size(bb, max(1, total // bb), rounds, connections)
        if pool_auth:  # the same again against a pool with --auth-dir (CurveZMQ, data-port tokens): paths "+auth"
            rows += [r for r in _bench_size(bb, max(1, total // bb), rounds, connections, auth=True)
                     if r["path"] != "raw-socket"]
    if mooncake:
        from kvtier.bench.pool_mooncake import bench_mooncake

        mc_rows, note = bench_mooncake(sizes, total, rounds, raw=_raw_baselines(rows))
        rows += mc_rows
        if note:
            print(note)
    _print_comparison(rows)
    return rows


def _bench_size(bb: int, n: int, rounds: int, connections: int, auth: bool = False) -> list[dict[str, Any]]:
    nbytes = n * bb
    src = torch.arange(nbytes, dtype=torch.int32).to(torch.uint8).view(n, bb)  # not constant: catches mixups
    src[:, :8] = torch.arange(n, dtype=torch.int64).view(n, 1).view(torch.uint8)  # every block distinct
    out = torch.empty_like(src)
    src_rows = np.uint64(src.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(bb)
    out_rows = np.uint64(out.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(bb)
    ns = Namespace(f"bench-pool-{bb}")
    times: dict[str, list[float]] = {}
    with PoolDaemon(nbytes + 4 * bb, bb, ipc=True, auth=auth) as pool, _RawPeer(nbytes) as raw, \
            HostCopies(src.numpy(), out.numpy()) as copies:
        on_tcp, on_ipc = pool.endpoint("tcp"), pool.endpoint("ipc")
        tcp = connect(on_tcp, bb, transport="tcp", timeout_s=30.0, lanes=connections, auth=pool.client_auth(on_tcp))
        stream = connect(on_tcp, bb, transport="stream", timeout_s=30.0, lanes=connections,
                         auth=pool.client_auth(on_tcp))
        shm = connect(on_ipc, bb, transport="shm", timeout_s=30.0, auth=pool.client_auth(on_ipc))
        shm1 = connect(on_ipc, bb, transport="shm", timeout_s=30.0, auth=pool.client_auth(on_ipc), copy_threads=1)
        try:
            for r in range(rounds + 1):
                keys = ns.keys(range(r * n, (r + 1) * n))
                t = {
                    "raw put": time_once(lambda: raw.put(src)),
                    "raw get": time_once(lambda: raw.get(out)),
                }
                _check(out, src, "raw socket", bb)
                out.zero_()
                t["stream put"] = time_once(lambda: _all(stream.put(keys, src_rows), "stream put", bb))
                t["stream get"] = time_once(lambda: _all(stream.get(keys, out_rows), "stream get", bb))
                _check(out, src, "pool stream", bb)
                stream.remove(keys)
                out.zero_()
                t["tcp put"] = time_once(lambda: _all(tcp.put(keys, src_rows), "tcp put", bb))
                t["tcp get"] = time_once(lambda: _all(tcp.get(keys, out_rows), "tcp get", bb))
                _check(out, src, "pool tcp", bb)
                tcp.remove(keys)
                out.zero_()
                copies.round(keep=r > 0)
                out.zero_()
                t["shm put"] = time_once(lambda: _all(shm.put(keys, src_rows), "shm put", bb))
                t["shm get"] = time_once(lambda: _all(shm.get(keys, out_rows), "shm get", bb))
                _check(out, src, "pool shm", bb)
                shm.remove(keys)
                out.zero_()
                t["shm-1thread put"] = time_once(lambda: _all(shm1.put(keys, src_rows), "shm-1thread put", bb))
                t["shm-1thread get"] = time_once(lambda: _all(shm1.get(keys, out_rows), "shm-1thread get", bb))
                _check(out, src, "pool shm on one thread", bb)
                shm1.remove(keys)
                if r:
                    for k, v in t.items():
                        times.setdefault(k, []).append(v)
            pages = shm.pages()  # the pool's shared file as this process maps it
        finally:
            for conn in (tcp, stream, shm, shm1):
                conn.close()
    fig = {k: gbps(nbytes, median(v)) for k, v in times.items()}
    out_rows_: list[dict[str, Any]] = []
    tag = "+auth" if auth else ""
    for op in OPS:
        out_rows_.append(row({"tier": "pool", "path": "raw-socket", "op": op, "block_bytes": bb},
                             fig[f"raw {op}"], fig[f"raw {op}"]))
        for path in ("stream", "tcp"):
            out_rows_.append(row({"tier": "pool", "path": path + tag, "op": op, "block_bytes": bb},
                                 fig[f"{path} {op}"], fig[f"raw {op}"]))
    best_name, best = copies.best()
    out_rows_ += copies.rows({"tier": "pool", "block_bytes": bb})
    for path in ("shm", "shm-1thread"):
        for op in OPS:
            out_rows_.append(row({"tier": "pool", "path": path + tag, "op": op, "block_bytes": bb},
                                 fig[f"{path} {op}"], best))
    print(f"pool bench {bb >> 10} KiB blocks: the shm rows' baseline is {best_name} ({best:.2f} GB/s), the fastest "
          f"copy of the same bytes in the same rounds; the pool's shared file is on {pages} pages here")
    return out_rows_


def _all(held: list[bool], what: str, bb: int) -> None:
    if not all(held):
        raise RuntimeError(f"pool bench: {what} at {bb} B blocks stored/found {sum(held)} of {len(held)} blocks")


def _check(out: torch.Tensor, src: torch.Tensor, what: str, bb: int) -> None:
    if not torch.equal(out, src):
        raise RuntimeError(f"pool bench: bytes read back through {what} differ from bytes written at {bb} B blocks")


def _raw_baselines(rows: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    return {(r["op"], r["block_bytes"]): r["gbps"] for r in rows if r["path"] == "raw-socket"}


def _print_comparison(rows: list[dict[str, Any]]) -> None:
    mc = {(r["op"], r["block_bytes"]): r["gbps"] for r in rows if r["path"] == "mooncake"}
    if not mc:
        return
    print("\nkvtier (TCP paths) / Mooncake Store tcp, same run:")
    for r in rows:
        if r["path"] in ("stream", "tcp") and (r["op"], r["block_bytes"]) in mc:
            print(f"  {r['path']:>6} {r['op']:>4} {r['block_bytes'] >> 10:>5} KiB: {r['gbps']:.2f} / "
                  f"{mc[(r['op'], r['block_bytes'])]:.2f} GB/s = {r['gbps'] / mc[(r['op'], r['block_bytes'])]:.2f}x")


class _RawPeer:
    """The raw-socket baseline's other process: receives a batch into one buffer (put) or sends it (get)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        ctx = mp.get_context("spawn")
        self._ports = ctx.Queue()
        self._proc = ctx.Process(target=_raw_peer, args=(self._ports, nbytes), daemon=True)
        self._sock = socket.socket()

    def __enter__(self) -> _RawPeer:
        self._proc.start()
        self._sock.connect(("127.0.0.1", self._ports.get(timeout=60)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def put(self, src: torch.Tensor) -> None:
        self._sock.sendall(b"P")
        self._sock.sendall(memoryview(src.numpy()).cast("B"))
        _recv_exact(self._sock, memoryview(bytearray(1)))

    def get(self, out: torch.Tensor) -> None:
        self._sock.sendall(b"G")
        _recv_exact(self._sock, memoryview(out.numpy()).cast("B"))

    def __exit__(self, *exc: object) -> None:
        try:
            self._sock.sendall(b"Q")
        except OSError:
            pass
        self._sock.close()
        self._proc.join(30)


def _raw_peer(ports: Any, nbytes: int) -> None:
    """The raw peer process: one connection; 'P' receive a batch and ack, 'G' send it back, 'Q' quit."""
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    buf = np.empty(nbytes, np.uint8)
    view = memoryview(buf)
    cmd = memoryview(bytearray(1))
    while True:
        _recv_exact(conn, cmd)
        if cmd[0] == ord("P"):
            _recv_exact(conn, view)
            conn.sendall(b"k")
        elif cmd[0] == ord("G"):
            conn.sendall(view)
        else:
            break
    conn.close()
    listener.close()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("raw-socket peer closed the connection")
        got += n


__all__ = ["DEFAULT_SIZES", "bench_pool"]
