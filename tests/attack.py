"""Hostile peers for the pool's hardening tests: what a stranger on the same network (or host) does with real
sockets. A raw zmq client that speaks the pool's protocol by hand (and never reads, if asked), a TCP proxy
that trickles one direction, a unix-socket proxy for ipc, and readings of a daemon's memory."""

from __future__ import annotations

import itertools
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import secure_client


def status_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in KiB (VmRSS: resident now; VmHWM: the peak)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def rss_mib(pid: int) -> float:
    return status_kib(pid, "VmRSS") / 1024


def peak_mib(pid: int) -> float:
    return status_kib(pid, "VmHWM") / 1024


def reset_peak(pid: int) -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs), so a peak measures one phase."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class RawClient:
    """A zmq DEALER speaking the pool's wire protocol by hand: any op, any body, with or without waiting. It
    presents the owner token of a keyless pool (a hostile process of the pool's own user, or anyone where the
    pool runs --insecure-bind: another user cannot get this far, test_owner_token.py)."""

    def __init__(self, endpoint: str, *, sndhwm: int = 1000, rcvhwm: int = 1000,
                 ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        secure_client(self.sock, endpoint, None)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)

    def send(self, op: str, body: dict[str, Any], data: tuple = ()) -> int:
        req_id = next(self._ids)
        self.sock.send_multipart([wire.encode_request(req_id, op, body), *data])
        return req_id

    def call(self, op: str, body: dict[str, Any], data: tuple = (), timeout_s: float = 5.0
             ) -> tuple[bool, dict[str, Any], list[bytes]]:
        """(ok, reply body, data frames) of one request; TimeoutError without a reply."""
        req_id = self.send(op, body, data)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                raise TimeoutError(f"{op}: no reply within {timeout_s} s")
            frames = self.sock.recv_multipart()
            rid, ok, body = wire.decode_reply(frames[0], peer="the pool")
            if rid == req_id:
                return ok, body, frames[1:]

    def close(self) -> None:
        self.sock.close(linger=0)


class TrickleProxy:
    """A TCP proxy listening on ``listen`` (host, port) for ``target`` (host, port). Bytes from the client go
    through at once; bytes from the target go through at once until ``trickle`` is set, then one byte every
    ``interval_s`` (a pool on a dying link, or a hostile one). One thread per direction per connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], interval_s: float = 0.3) -> None:
        listener = socket.create_server(listen, backlog=64)
        self._start(listener, listener.getsockname()[:2], target, interval_s)

    def _start(self, listener: socket.socket, address: Any, target: Any, interval_s: float) -> None:
        self.target, self.interval_s, self.address = target, interval_s, address
        self.trickle = threading.Event()
        self._stop = threading.Event()
        self._listener = listener
        self._listener.settimeout(0.1)
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _connect(self) -> socket.socket:
        """A blocking connection to the target (OSError if it does not answer)."""
        server = socket.create_connection(self.target, timeout=5.0)
        server.settimeout(None)
        return server

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            try:
                server = self._connect()
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while not self._stop.is_set():
                if not select.select([src], [], [], 0.1)[0]:
                    continue
                if slow and self.trickle.is_set():
                    b = src.recv(1)
                    if not b:
                        break
                    dst.sendall(b)
                    self._stop.wait(self.interval_s)
                    continue
                b = src.recv(1 << 16)
                if not b:
                    break
                dst.sendall(b)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


class UnixTrickleProxy(TrickleProxy):
    """The same for a unix socket (a pool's ipc:// endpoint): listens on ``path``, forwards to ``target_path``."""

    def __init__(self, path: str, target_path: str, interval_s: float = 0.3) -> None:  # noqa: D107
        if os.path.exists(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        self._start(listener, path, target_path, interval_s)

    def _connect(self) -> socket.socket:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.connect(self.target)
        except OSError:
            server.close()
            raise
        return server


def idle_connections(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to (host, port) that never send a byte."""
    return [socket.create_connection((host, port), timeout=5.0) for _ in range(n)]


def host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)
