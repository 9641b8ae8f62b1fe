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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.bench.common import gbps, median, row, time_once
from kvtier.bench.copies import HostCopies
from kvtier.keys import Namespace
from kvtier.pool.process import PoolDaemon
from kvtier.transport import PoolConnection, connect
from kvtier.transport.registry import known_transports
from kvtier.transport.registry import transport as registered

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


@dataclass
class _Path:
    """One transport as the bench measures it: rows ``name`` (``+auth`` added), its connection, and its baseline:
    the raw socket, or for a transport that maps the pool's memory (``maps_memory``) the best copy."""

    name: str
    conn: PoolConnection
    maps_memory: bool
    what: str  # how an error about the bytes read back names it


def _connect_paths(pool: PoolDaemon, bb: int, connections: int) -> list[_Path]:
    """A connection per transport of the table (kvtier/transport/registry.py) that the pool offers and this host
    can run: those over a socket first, then those that map the pool's memory, each in the table's order (stream,
    tcp, shm: rdma only where the pool serves it, and PoolDaemon starts it with --rdma off); a transport that
    copies host memory itself (shm) once more on one copy thread (``-1thread``: the default's before/after). A
    transport that runs on tcp:// is measured there, the others on the pool's ipc:// endpoint."""
    on_tcp = pool.endpoint("tcp")
    probe = connect(on_tcp, bb, transport="tcp", timeout_s=30.0, auth=pool.client_auth(on_tcp))  # every pool: tcp
    offered = probe.info.transports
    probe.close()
    table = [registered(name) for name in known_transports()]
    paths: list[_Path] = []
    try:
        for t in sorted(table, key=lambda t: t.maps_memory):  # stable: the table's order within each kind
            if t.offer not in offered or t.cannot_here() is not None:
                continue
            endpoint = pool.endpoint("tcp" if "tcp" in t.schemes else "ipc")
            lanes = {} if t.maps_memory else {"lanes": connections}
            opts = [({}, t.name, f"pool {t.name}")]
            if t.copy_threads:
                opts.append(({"copy_threads": 1}, f"{t.name}-1thread", f"pool {t.name} on one thread"))
            for extra, name, what in opts:
                conn = connect(endpoint, bb, transport=t.name, timeout_s=30.0, auth=pool.client_auth(endpoint),
                               **lanes, **extra)
                paths.append(_Path(name, conn, t.maps_memory, what))
    except BaseException:
        for p in paths:
            p.conn.close()
        raise
    return paths


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
        paths = _connect_paths(pool, bb, connections)
        sockets = [p for p in paths if not p.maps_memory]
        mapped = [p for p in paths if p.maps_memory]
        try:
            for r in range(rounds + 1):
                keys = ns.keys(range(r * n, (r + 1) * n))
                t = {
                    "raw put": time_once(lambda: raw.put(src)),
                    "raw get": time_once(lambda: raw.get(out)),
                }
                _check(out, src, "raw socket", bb)
                for p in sockets:
                    out.zero_()
                    t.update(_round_trip(p, keys, src_rows, out_rows, out, src, bb))
                out.zero_()
                copies.round(keep=r > 0)  # the mapped paths' baseline, measured right before them
                for p in mapped:
                    out.zero_()
                    t.update(_round_trip(p, keys, src_rows, out_rows, out, src, bb))
                if r:
                    for k, v in t.items():
                        times.setdefault(k, []).append(v)
            pages = mapped[0].conn.pages()  # the pool's shared file as this process maps it
        finally:
            for p in paths:
                p.conn.close()
    fig = {k: gbps(nbytes, median(v)) for k, v in times.items()}
    out_rows_: list[dict[str, Any]] = []
    tag = "+auth" if auth else ""
    for op in OPS:
        out_rows_.append(row({"tier": "pool", "path": "raw-socket", "op": op, "block_bytes": bb},
                             fig[f"raw {op}"], fig[f"raw {op}"]))
        for p in sockets:
            out_rows_.append(row({"tier": "pool", "path": p.name + tag, "op": op, "block_bytes": bb},
                                 fig[f"{p.name} {op}"], fig[f"raw {op}"]))
    best_name, best = copies.best()
    out_rows_ += copies.rows({"tier": "pool", "block_bytes": bb})
    for p in mapped:
        for op in OPS:
            out_rows_.append(row({"tier": "pool", "path": p.name + tag, "op": op, "block_bytes": bb},
                                 fig[f"{p.name} {op}"], best))
    print(f"pool bench {bb >> 10} KiB blocks: the shm rows' baseline is {best_name} ({best:.2f} GB/s), the fastest "
          f"copy of the same bytes in the same rounds; the pool's shared file is on {pages} pages here")
    return out_rows_


def _round_trip(p: _Path, keys: list[bytes], src_rows: np.ndarray, out_rows: np.ndarray, out: torch.Tensor,
                src: torch.Tensor, bb: int) -> dict[str, float]:
    """One round of a path: a timed put and get of the batch, the bytes checked, the keys removed."""
    conn, name = p.conn, p.name
    t = {f"{name} put": time_once(lambda: _all(conn.put(keys, src_rows), f"{name} put", bb)),
         f"{name} get": time_once(lambda: _all(conn.get(keys, out_rows), f"{name} get", bb))}
    _check(out, src, p.what, bb)
    conn.remove(keys)
    return t


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
