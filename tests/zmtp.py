"""Raw ZMTP 3.0 (NULL mechanism) connections for attack tests: a plain TCP socket that completes zmq's handshake
as a DEALER and then does what no zmq library would let a client do (declare a frame it never finishes, send
requests and never read a reply, sit idle forever). One socket per object; the caller's thread only."""

from __future__ import annotations

import socket
import struct


def greeting() -> bytes:
    """The 64-byte ZMTP 3.0 greeting of a NULL-mechanism client."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def ready(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def frame_header(size: int, more: bool = False) -> bytes:
    """A message frame's header (short form below 256 bytes, long form above)."""
    flags = 0x01 if more else 0x00
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | 0x02]) + struct.pack(">Q", size)


class RawPeer:
    """A handshaken raw connection to ``host:port`` (zmq's side of the handshake is not read: the kernel holds
    it). ``rcvbuf`` shrinks the socket's receive buffer so that a peer that never reads holds little."""

    def __init__(self, host: str, port: int, *, handshake: bool = True, rcvbuf: int | None = None,
                 timeout_s: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout_s)
        self.sock.connect((host, port))
        if handshake:
            self.sock.sendall(greeting() + ready())

    def send_message(self, payload: bytes) -> None:
        self.sock.sendall(frame_header(len(payload)) + payload)

    def closed_by_peer(self, wait_s: float) -> bool:
        """Whether the daemon closed this connection within ``wait_s`` (reading and dropping what it sent)."""
        self.sock.settimeout(wait_s)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (socket.timeout, TimeoutError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host, int(port)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096
