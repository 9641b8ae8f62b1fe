"""Issue 13 items 8 and 10 (pool part) against a real kvtier-pool: idle, unauthenticated or reconnecting peers
on the zmq port and the stream data port cannot lock honest clients out (they are counted and timed out apart
from admitted connections, and first); a declared envelope cannot allocate before its bytes arrive; the ipc
socket never inherits a permissive umask; a stranger's hello does not size an unsized pool."""

from __future__ import annotations

import shutil
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from attack import RawClient, host_port, idle_connections, rss_mib
from bytecheck import assert_no_wrong_bytes
from kvtier.auth import ClientKeys, generate
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from kvtier.wire import pool as P
from poolproc import PoolProcess, until

BB = 4096
ns = Namespace("hostile-ports")
SOFT_1024 = ("sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh")  # the usual default soft limit on open files


def rows(a: np.ndarray) -> np.ndarray:
    return np.uint64(a.ctypes.data) + np.arange(a.shape[0], dtype=np.uint64) * np.uint64(a.shape[1])


def round_trip(endpoint: str, keys: list[bytes], transport: str = "auto", auth: ClientKeys | None = None,
               timeout_s: float = 2.0, bb: int = BB) -> bool:
    """Connect, put and get back ``keys``; False if the pool failed any step within the timeout (a miss included);
    a wrong byte fails the test at once."""
    src = np.stack([np.full(bb, i % 250 + 1, np.uint8) for i in range(len(keys))])
    out = np.zeros_like(src)
    try:
        c = connect(endpoint, bb, transport=transport, timeout_s=timeout_s, auth=auth)
    except PoolError:
        return False
    try:
        if not all(c.put(keys, rows(src))):
            return False
        return not assert_no_wrong_bytes(c.get(keys, rows(out)), out, src).misses
    except PoolError:
        return False
    finally:
        c.close()


def data_port(endpoint: str, auth: ClientKeys | None = None) -> int:
    c = connect(endpoint, BB, timeout_s=5.0, auth=auth)
    try:
        return int(c.info.transports["stream"]["port"])
    finally:
        c.close()


def closed(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the pool has closed (what it sent first, e.g. zmq's greeting, is read and dropped)."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            while s.recv(4096):
                pass
            n += 1  # the end of the stream
        except BlockingIOError:
            pass  # still open
        except OSError:
            n += 1  # reset
    return n


# ---- the zmq port ------------------------------------------------------------------------------------------

def test_idle_connections_on_the_zmq_port_do_not_lock_clients_out(tmp_path):
    """1,100 connections that never say a word, to a pool started under the common soft limit of 1,024 open
    files: the pool raises its own limit, and an honest client is still served at once."""
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, prefix=SOFT_1024) as p:
        host, port = host_port(p.tcp)
        idle = idle_connections(host, port, 1100)
        try:
            assert round_trip(p.tcp, ns.keys(range(8)), transport="tcp")
        finally:
            for s in idle:
                s.close()


def test_connections_that_never_complete_a_handshake_are_timed_out(tmp_path):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB) as p:
        idle = idle_connections(*host_port(p.tcp), 50)
        try:
            assert until(lambda: closed(idle) == 50, timeout=8.0), f"{closed(idle)} of 50 idle connections closed"
            c = connect(p.tcp, BB, timeout_s=5.0)
            assert c.stats()["counters"].get("zmq_handshake_timeouts", 0) >= 50
            c.close()
        finally:
            for s in idle:
                s.close()


# ---- the stream data port ----------------------------------------------------------------------------------

def test_idle_connections_on_the_data_port_do_not_lock_clients_out(tmp_path):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB) as p:
        port = data_port(p.tcp)
        idle = idle_connections(host_port(p.tcp)[0], port, 1000)
        try:
            t0 = time.monotonic()
            assert round_trip(p.tcp, ns.keys(range(100, 108)), transport="stream")
            assert time.monotonic() - t0 < 3.0
        finally:
            for s in idle:
                s.close()


@pytest.fixture
def auth_keys(tmp_path) -> dict[str, Path]:
    daemon, good = tmp_path / "daemon", tmp_path / "good"
    generate(daemon, "server")
    generate(good)
    (daemon / "authorized").mkdir()
    shutil.copy(good / "client.key", daemon / "authorized" / "engine-1.key")
    shutil.copy(daemon / "server.key", good / "server.key")
    return {"daemon": daemon, "good": good}


def test_a_peer_reconnecting_in_a_loop_without_a_token_does_not_keep_honest_calls_out(tmp_path, auth_keys):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=("--auth-dir", str(auth_keys["daemon"]),
                                                                       "--stream-max-connections", "64")) as p:
        auth = ClientKeys.load(auth_keys["good"], p.tcp)
        host, port = host_port(p.tcp)[0], data_port(p.tcp, auth)
        stop = threading.Event()
        opened = [0]  # connections the attackers opened so far (a count; += of an int is one step under the GIL)

        def flood() -> None:  # connections that never send a token, opened as fast as the pool closes them
            held: list[socket.socket] = []
            while not stop.is_set():
                try:
                    held.append(socket.create_connection((host, port), timeout=1.0))
                    opened[0] += 1
                except OSError:
                    time.sleep(0.01)
                if len(held) > 200:
                    held.pop(0).close()
            for s in held:
                s.close()
        attackers = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
        for t in attackers:
            t.start()
        try:
            assert until(lambda: opened[0] >= 256, timeout=30.0, interval=0.01)  # the flood is on: past the limit
            # 5 s per honest call: the flood shares a loaded 2-core machine with it, and what is tested is that
            # a call gets in at all (the code before locked them out for the whole flood: 8 of 40)
            ok = sum(round_trip(p.tcp, ns.keys(range(200 + 4 * i, 204 + 4 * i)), transport="stream", auth=auth,
                                timeout_s=5.0) for i in range(40))
        finally:
            stop.set()
            for t in attackers:
                t.join(10)
        assert ok == 40, f"only {ok} of 40 honest calls got through"


def test_a_declared_envelope_allocates_nothing_before_its_bytes_arrive(tmp_path):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB) as p:
        port = data_port(p.tcp)
        base = rss_mib(p.proc.pid)
        socks = []
        for _ in range(60):  # each declares a 16 MiB envelope, sends a few bytes of it, then waits
            s = socket.create_connection((host_port(p.tcp)[0], port))
            s.sendall(struct.pack("<I", 16 << 20) + b"\x93" * 100)
            socks.append(s)
        time.sleep(1.5)
        grown = rss_mib(p.proc.pid) - base
        try:
            assert grown < 48, f"60 declared envelopes grew the pool by {grown:.0f} MiB"
            assert round_trip(p.tcp, ns.keys(range(300, 304)), transport="stream")
        finally:
            for s in socks:
                s.close()


# ---- item 10: the ipc socket's mode, and who sizes an unsized pool -------------------------------------------

def test_the_ipc_socket_is_the_owners_only_whatever_the_umask(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB,
                     prefix=("sh", "-c", 'umask 000 && exec "$@"', "sh")) as p:
        sock = Path(p.ipc[len("ipc://"):])
        assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0, oct(sock.stat().st_mode)
        for f in tmp_path.glob("kvtier-pool-*"):
            assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, (f, oct(f.stat().st_mode))


def test_a_strangers_hello_does_not_size_an_unsized_pool(tmp_path):
    with PoolProcess(tmp_path, ipc=True, capacity="8MiB") as p:
        stranger = RawClient(p.tcp)
        ok, body, _ = stranger.call(P.HELLO, {"block_bytes": 512})
        stranger.close()
        bb = 32 << 10
        assert round_trip(p.tcp, ns.keys(range(400, 404)), transport="stream", bb=bb)
        assert round_trip(p.ipc, ns.keys(range(404, 408)), bb=bb)  # and over shared memory
        assert round_trip(p.tcp, ns.keys(range(408, 412)), transport="tcp", bb=bb)
