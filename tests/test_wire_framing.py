"""kvtier/wire/framing.py, the stream data port's framing both ends speak, over a real socket pair: whatever way
the bytes are cut on the sending side and the receiving side (and however the kernel splits them), a message
arrives whole and in order; a peer that trickles or stops is a timeout or a ConnectionError by the deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.wire.framing import HEADER, read_envelope, recv_exact, recv_views, send_message, send_message_raw


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):  # small buffers: big messages take many partial sendmsg / recvmsg_into calls
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return a, b


def _cut(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut at the given sizes (the rest in one last piece)."""
    out, at = [], 0
    for n in sizes:
        out.append(data[at : at + n])
        at += n
    return [*out, data[at:]]


@settings(max_examples=40, deadline=None)
@given(envelope=st.binary(max_size=3000), payload=st.binary(max_size=200_000),
       send_cuts=st.lists(st.integers(0, 70_000), max_size=6), recv_cuts=st.lists(st.integers(0, 70_000), max_size=6))
def test_a_message_arrives_whole_however_it_is_cut(envelope, payload, send_cuts, recv_cuts):
    a, b = _pair()
    failed: list[BaseException] = []

    def send() -> None:
        try:
            send_message(a, envelope, _cut(payload, send_cuts), deadline=time.monotonic() + 3)
        except BaseException as e:  # noqa: BLE001 -- reported by the test below
            failed.append(e)
    try:
        sender = threading.Thread(target=send)
        sender.start()  # the socket pair's buffers hold a part of the message: it is read while being sent
        deadline = time.monotonic() + 3
        got = read_envelope(b, deadline=deadline)
        views = [memoryview(bytearray(len(p))) for p in _cut(payload, recv_cuts)]
        recv_views(b, views, deadline=deadline)
        sender.join(5)
        assert not failed, f"send_message failed: {failed[0]!r}"
        assert got == envelope
        assert b"".join(bytes(v) for v in views) == payload
    finally:
        a.close()
        b.close()


def test_a_trickled_envelope_is_put_together_and_a_clean_end_is_none():
    a, b = _pair()
    try:
        message = HEADER.pack(5) + b"hello"
        t = threading.Thread(target=lambda: [send_message_raw(a, message[i : i + 1], deadline=time.monotonic() + 5)
                                             for i in range(len(message))])
        t.start()
        assert read_envelope(b, deadline=time.monotonic() + 5) == b"hello"
        t.join()
        a.shutdown(socket.SHUT_WR)
        assert read_envelope(b, deadline=time.monotonic() + 5) is None
    finally:
        a.close()
        b.close()


def test_a_peer_that_stops_mid_message_ends_by_the_deadline_or_as_closed():
    a, b = _pair()
    try:
        send_message_raw(a, HEADER.pack(10) + b"abc", deadline=time.monotonic() + 5)  # 7 bytes short
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            read_envelope(b, deadline=time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 3.0
        a.close()
        with pytest.raises(ConnectionError):
            recv_exact(b, memoryview(bytearray(4)), deadline=time.monotonic() + 5)
    finally:
        b.close()


def test_an_envelope_over_the_limit_or_past_the_budget_is_refused_before_its_body():
    a, b = _pair()
    try:
        send_message_raw(a, HEADER.pack(1 << 30), deadline=time.monotonic() + 5)
        with pytest.raises(wire.WireError) as err:
            read_envelope(b, deadline=time.monotonic() + 5, max_bytes=1 << 20)
        assert err.value.code == wire.ERR_TOO_LARGE
        send_message_raw(a, HEADER.pack(100) + b"x" * 100, deadline=time.monotonic() + 5)
        with pytest.raises(wire.WireError) as err:
            read_envelope(b, deadline=time.monotonic() + 5, charge=lambda n: False)
        assert err.value.code == "busy"
    finally:
        a.close()
        b.close()


def test_an_empty_payload_buffer_is_skipped_not_spun_on():
    """A zero-length buffer among the payload (a run of no rows) is sent as nothing. Before, sendmsg's 0 bytes
    for it never moved the loop on: the sender spun at full CPU until its deadline and failed."""
    a, b = _pair()
    try:
        send_message(a, b"env", [b"", b"abc", memoryview(b"")], deadline=time.monotonic() + 1.0)
        assert read_envelope(b, deadline=time.monotonic() + 1.0) == b"env"
        got = memoryview(bytearray(3))
        recv_exact(b, got, deadline=time.monotonic() + 1.0)
        assert bytes(got) == b"abc"
    finally:
        a.close()
        b.close()
