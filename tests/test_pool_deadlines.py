"""Issue 13 item 3: every call on every client transport ends by its deadline whatever the pool does. A real
kvtier-pool sits behind a proxy that, once told to, passes the pool's bytes on one every 0.3 s (a dying link or
a hostile pool: the socket always makes progress, so a per-read timeout never fires)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from attack import TrickleProxy, UnixTrickleProxy, host_port
from kvtier.auth.owner import runtime_dir, token_name
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from poolproc import PoolProcess, finishes

BB = 64 << 10
TIMEOUT_S = 0.5
ns = Namespace("deadlines")


def rows(a: np.ndarray) -> np.ndarray:
    return np.uint64(a.ctypes.data) + np.arange(a.shape[0], dtype=np.uint64) * np.uint64(a.shape[1])


def alias_token(alias: str, endpoint: str) -> None:
    """The keyless pool's owner token under the proxy's endpoint too, where a client dialing it looks (the tcp
    proxies listen on the pool's port numbers, which name the token already)."""
    d = runtime_dir()
    target = d / token_name(alias)
    target.write_bytes((d / token_name(endpoint)).read_bytes())
    target.chmod(0o600)


def deadline_of(nbytes: int) -> float:
    """A call's deadline: the timeout plus its bytes at the slowest bandwidth a call may take (100 MB/s)."""
    return TIMEOUT_S + nbytes / 100e6


def ended_in_time(fn, nbytes: int) -> float:
    """Run fn (a pool call); it must end (any PoolError is fine: a miss) within its deadline plus scheduling
    slack on a busy 2-core machine. Returns how long it took."""
    t0 = time.monotonic()
    try:
        finishes(fn, timeout=20.0)
    except PoolError:
        pass
    took = time.monotonic() - t0
    assert took < deadline_of(nbytes) + 1.5, f"the call took {took:.2f} s, its deadline is {deadline_of(nbytes):.2f} s"
    return took


@pytest.fixture  # one per test: its proxies listen on 127.0.0.2 at the pool's own port numbers
def tcp_pool(tmp_path):
    with PoolProcess(tmp_path, capacity="16MiB", block_bytes=BB) as p:
        yield p


# One pool for the shared-memory tests, not one each (a start costs seconds on a loaded machine): each test has
# its own proxy socket and connection, and reads only the blocks it put.
@pytest.fixture(scope="module")
def ipc_pool(tmp_path_factory):
    with PoolProcess(tmp_path_factory.mktemp("ipc-pool"), ipc=True, tcp=False, capacity="16MiB", block_bytes=BB) as p:
        yield p


def proxied(pool: PoolProcess, stream: bool) -> tuple[str, list[TrickleProxy]]:
    """Proxies on 127.0.0.2 in front of the pool's zmq port and (same port number) its data port; the
    endpoint a client uses to go through them."""
    host, port = host_port(pool.tcp)
    proxies = [TrickleProxy(("127.0.0.2", port), (host, port))]
    if stream:
        c = connect(pool.tcp, BB, timeout_s=5.0)
        data = int(c.info.transports["stream"]["port"])
        c.close()
        proxies.append(TrickleProxy(("127.0.0.2", data), (host, data)))
    return f"tcp://127.0.0.2:{port}", proxies


# Each transport with one op in the default suite (a pool start each), the other two in the slow one.
@pytest.mark.parametrize("transport, op", [("stream", "get"), ("tcp", "put"),
                                           pytest.param("stream", "put", marks=pytest.mark.slow),
                                           pytest.param("tcp", "get", marks=pytest.mark.slow)])
def test_a_trickling_pool_cannot_hold_a_tcp_call_past_its_deadline(tcp_pool, transport, op):
    keys = ns.keys(range(4))
    src = np.full((4, BB), 7, np.uint8)
    direct = connect(tcp_pool.tcp, BB, timeout_s=5.0)
    assert all(direct.put(keys, rows(src)))
    endpoint, proxies = proxied(tcp_pool, stream=transport == "stream")
    conn = connect(endpoint, BB, transport=transport, timeout_s=TIMEOUT_S)
    out = np.zeros((4, BB), np.uint8)
    try:
        assert conn.get(keys, rows(out)) == [True] * 4  # through the proxy at full speed first
        for px in proxies:
            px.trickle.set()
        if op == "get":
            ended_in_time(lambda: conn.get(keys, rows(out)), out.nbytes)
        else:
            ended_in_time(lambda: conn.put(ns.keys(range(10, 14)), rows(src)), src.nbytes)
        ended_in_time(lambda: conn.contains(keys), 0)
    finally:
        for px in proxies:
            px.close()
        conn.close()
        direct.close()


@pytest.mark.parametrize("op", ["get", "put", "contains"])
def test_a_trickling_pool_cannot_hold_a_shared_memory_call_past_its_deadline(ipc_pool, tmp_path, op):
    keys = ns.keys(range(20, 24))
    src = np.full((4, BB), 9, np.uint8)
    direct = connect(ipc_pool.ipc, BB, timeout_s=5.0)
    assert all(direct.put(keys, rows(src)))
    px = UnixTrickleProxy(str(tmp_path / "proxy.sock"), ipc_pool.ipc[len("ipc://"):])
    alias_token(f"ipc://{px.address}", ipc_pool.ipc)
    conn = connect(f"ipc://{px.address}", BB, timeout_s=TIMEOUT_S)
    out = np.zeros((4, BB), np.uint8)
    try:
        assert conn.get(keys, rows(out)) == [True] * 4
        px.trickle.set()
        call = {"get": lambda: conn.get(keys, rows(out)), "put": lambda: conn.put(ns.keys(range(30, 34)), rows(src)),
                "contains": lambda: conn.contains(keys)}[op]
        ended_in_time(call, src.nbytes)
    finally:
        px.close()
        conn.close()
        direct.close()
        (runtime_dir() / token_name(f"ipc://{px.address}")).unlink(missing_ok=True)
