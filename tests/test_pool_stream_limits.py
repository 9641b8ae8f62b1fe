"""The pool's raw TCP data port under idle and slow peers (a real kvtier-pool): connections that never send a
request hold no thread and are closed after the handshake time; admitted connections are capped (the one idle
the longest makes room, a newcomer is refused only when all are mid-message, with a log line); a peer that
starts a message and then trickles bytes is dropped at the message's deadline. None can pin the daemon's
threads, and the pool keeps serving real clients."""

from __future__ import annotations

import select
import socket
import struct
import threading
from pathlib import Path

import torch

from bytecheck import assert_all_hits_exact, assert_no_wrong_bytes
from conftest import blocks_for
from kvtier import wire
from kvtier.blocks import block_rows
from kvtier.keys import Namespace
from kvtier.pool.stream import MAX_CONNECTIONS
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from kvtier.wire import pool as P
from poolproc import PoolProcess, until

BB = 4096
# These peers speak the data port without a token: a pool serving every local user (--insecure-bind) admits
# them as data connections, which is what these limits are about (a keyless pool's data port wants the token
# its hello hands out: test_owner_token.py, test_auth.py).
OPEN = ("--insecure-bind",)


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def closed_by_peer(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the other end has closed (readable, and reading gives the end of the stream)."""
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    closed = 0
    for s in socks:
        if s.fileno() in ready:
            try:
                closed += s.recv(1, socket.MSG_PEEK) == b""
            except OSError:  # reset
                closed += 1
    return closed


def data_port(endpoint: str) -> int:
    c = connect(endpoint, BB, timeout_s=5.0)
    try:
        return int(c.info.transports["stream"]["port"])
    finally:
        c.close()


def round_trip(endpoint: str, keys: list[bytes]) -> bool:
    """Put and get back ``keys`` over the data port; False if the pool failed either (a miss included); a wrong
    byte fails the test at once."""
    c = connect(endpoint, BB, transport="stream", timeout_s=5.0)
    try:
        data = blocks_for(keys, BB)
        out = torch.zeros_like(data)
        if not all(c.put(keys, block_rows(data, len(keys), BB).ptrs)):
            return False
        got = assert_no_wrong_bytes(c.get(keys, block_rows(out, len(keys), BB, writable=True).ptrs), out, data)
        return not got.misses
    except PoolError:
        return False
    finally:
        c.close()


def mid_message(port: int, n: int, sources: list[str] | None = None) -> list[socket.socket]:
    """``n`` admitted connections stuck inside a message: a put's envelope for 4 blocks, then no payload (from
    ``sources``, one loopback address each, or all from 127.0.0.1)."""
    keys = Namespace("mid-message").keys(range(4))
    envelope = wire.encode_request(1, P.PUT, {"keys": wire.pack_keys(keys), "block_bytes": BB})
    socks = []
    for i in range(n):
        src = (sources[i] if sources else "127.0.0.1", 0)
        c = socket.create_connection(("127.0.0.1", port), source_address=src)
        c.sendall(struct.pack("<I", len(envelope)) + envelope)
        socks.append(c)
    return socks


def test_connections_that_never_send_hold_no_thread_and_are_closed_after_the_handshake_time(tmp_path, make_keys):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--handshake-s", "1")) as p:
        port = data_port(p.tcp)
        base = threads_of(p.proc.pid)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 40)]
        try:
            assert threads_of(p.proc.pid) <= base + 2  # pending: no thread each
            assert round_trip(p.tcp, make_keys(4))  # and nobody is locked out meanwhile
            assert until(lambda: closed_by_peer(socks) == len(socks), timeout=10)
        finally:
            for s in socks:
                s.close()
        assert until(lambda: "nothing within 1 s" in p.log())


def test_admitted_connections_are_capped_and_the_one_idle_the_longest_makes_room(tmp_path, make_keys):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--stream-max-connections", "4")) as p:
        port = data_port(p.tcp)
        base = threads_of(p.proc.pid)
        busy = mid_message(port, 4, ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"])  # two peers, two each
        try:
            assert until(lambda: threads_of(p.proc.pid) >= base + 4)
            assert not round_trip(p.tcp, make_keys(4))  # all four mid-message: a newcomer is refused
            assert until(lambda: "refused" in p.log() and "max_connections" in p.log())
            assert threads_of(p.proc.pid) <= base + 4
        finally:
            for s in busy:
                s.close()
        assert until(lambda: threads_of(p.proc.pid) <= base + 1)
        # Idle admitted connections (a client's pooled sockets) make room for a newcomer instead: here among
        # its own peer's (one host may hold half of the port, 2 connections).
        clients = [connect(p.tcp, BB, transport="stream", timeout_s=5.0) for _ in range(2)]
        try:
            for i, c in enumerate(clients):
                keys = make_keys(2, start=10 * i)
                data = blocks_for(keys, BB)
                assert all(c.put(keys, block_rows(data, 2, BB).ptrs))  # each leaves an idle data socket
            assert round_trip(p.tcp, make_keys(4, start=100))  # admitted: the oldest idle one was closed
            keys = make_keys(2)
            out = torch.zeros(2, BB, dtype=torch.uint8)  # the client whose socket went opens a fresh one
            assert all(clients[0].get(keys, block_rows(out, 2, BB, writable=True).ptrs))
        finally:
            for c in clients:
                c.close()


def test_one_peer_holds_at_most_half_of_the_data_port(tmp_path, make_keys):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--stream-max-connections", "8")) as p:
        port = data_port(p.tcp)
        busy = mid_message(port, 8, ["127.0.0.2"] * 8)  # one peer tries to take the whole port
        try:
            assert until(lambda: closed_by_peer(busy) >= 4)
            assert closed_by_peer(busy) == 4  # its half stays, the rest is refused
            assert round_trip(p.tcp, make_keys(4))  # another peer (127.0.0.1) is served
        finally:
            for s in busy:
                s.close()


def test_a_connection_that_sends_a_byte_and_stalls_holds_its_thread_only_briefly(tmp_path, make_keys):
    """A first byte admits a connection (no --auth-dir); its envelope must follow within --handshake-s, not
    within the whole message's 30 s, or a few hundred such connections would keep the port full."""
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--stream-max-connections", "16",
                                                                       "--handshake-s", "1")) as p:
        port = data_port(p.tcp)
        stalled = []
        for i in range(16):
            c = socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i % 2}", 0))
            c.sendall(b"\x10")  # the first byte of a length prefix, then nothing
            stalled.append(c)
        try:
            assert until(lambda: closed_by_peer(stalled) == 16, timeout=6.0)
            assert round_trip(p.tcp, make_keys(4))
        finally:
            for s in stalled:
                s.close()


def test_a_peer_trickling_a_message_is_dropped_at_its_deadline(tmp_path, make_keys):
    # 1 s for a whole message (the default is 30 s); the socket's own timeout (lease_s, 30 s) never fires.
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--stream-message-timeout-s", "1")) as p:
        port = data_port(p.tcp)
        slow = socket.create_connection(("127.0.0.1", port))
        stop = threading.Event()
        sent = []

        def trickle() -> None:  # a header promising 1000 bytes, then one byte every 0.3 s: always "progress"
            try:
                slow.sendall(struct.pack("<I", 1000))
                while not stop.wait(0.3):
                    slow.sendall(b"\x00")
                    sent.append(1)
            except OSError:
                pass

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        try:
            assert until(lambda: closed_by_peer([slow]), timeout=20)
            assert len(sent) < 1000  # dropped mid-message, not after it ended
            assert until(lambda: "not done within" in p.log())
            assert round_trip(p.tcp, make_keys(4))  # the pool serves on
        finally:
            stop.set()
            t.join()
            slow.close()


def test_a_data_socket_the_pool_dropped_while_idle_is_replaced_not_a_failed_request(tmp_path, make_keys):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--lease-s", "1")) as p:
        c = connect(p.tcp, BB, transport="stream", timeout_s=5.0)
        try:
            keys = make_keys(4)
            data = blocks_for(keys, BB)
            assert all(c.put(keys, block_rows(data, 4, BB).ptrs))
            idle = list(c._free)
            assert idle  # the data socket waits in the client's free list
            assert until(lambda: closed_by_peer(idle) == len(idle), timeout=10)  # the pool's idle timeout
            out = torch.zeros_like(data)
            hit = c.get(keys, block_rows(out, 4, BB, writable=True).ptrs)  # no PoolUnavailable
            assert_all_hits_exact(hit, out, data)
        finally:
            c.close()


def test_the_connection_limit_is_an_operator_setting(tmp_path):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=(*OPEN, "--stream-max-connections", "3")) as p:
        port = data_port(p.tcp)
        socks = mid_message(port, 5, [f"127.0.0.{2 + i}" for i in range(5)])  # five peers, one each
        try:
            assert until(lambda: closed_by_peer(socks) >= 2)
            assert closed_by_peer(socks) == 2
        finally:
            for s in socks:
                s.close()
