"""Hypothesis throws malformed, mistyped, unknown and oversized requests (with random data frames) at a running
kvtier-pool; every one gets an error reply naming the problem (never ERR_INTERNAL) or a valid answer, and
after each the pool still serves a known get byte for byte."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import wire
from kvtier.auth import secure_client
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.wire import pool as P
from poolproc import PoolProcess

BB = 4096
MAX_KEYS = 64
PROBE = Namespace("pool-fuzz-probe").keys(range(8))
KNOWN_CODES = {wire.ERR_BAD_MESSAGE, wire.ERR_BAD_VERSION, wire.ERR_UNKNOWN_OP, wire.ERR_BAD_REQUEST,
               wire.ERR_TOO_LARGE, P.ERR_NOT_READY}
OPS = [P.HELLO, P.CONTAINS, P.REMOVE, P.PUT, P.GET, P.RESERVE, P.COMMIT, P.ACQUIRE, P.RELEASE, P.STATS,
       P.RDMA_CONNECT, P.OBSERVE]
FIELDS = ["keys", "block_bytes", "lease", "ok", "leases", "oks", "noreply", "qpn", "psn", "gid", "lid", "mtu",
          "now", "scope", "arrivals", "completions", "hints"]

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.binary(max_size=48))
key_blobs = st.sampled_from([0, 1, 3, 64, 65, 1000]).map(lambda n: b"k" * 16 * n) | \
    st.integers(0, 100).map(lambda n: b"x" * n)
values = st.recursive(scalars | key_blobs | st.sampled_from([BB, 0, 1, BB * 2, 2**40]),
                      lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4),
                      max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)
data_frames = st.lists(st.sampled_from([0, 1, 100, BB, BB + 1, 3 * BB]).map(bytes), max_size=4)


def packed(obj):
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc1"


requests = st.one_of(
    st.tuples(st.binary(max_size=200), data_frames),
    st.tuples(values.map(packed), data_frames),
    st.tuples(st.tuples(st.sampled_from([1, 0, 2, "1", None]), st.integers(0, 2**32) | scalars,
                        st.sampled_from(OPS) | st.text(max_size=12) | scalars, bodies | values)
              .map(lambda m: packed(list(m))), data_frames),
    st.tuples(st.tuples(st.sampled_from(OPS), bodies).map(lambda m: wire.encode_request(7, m[0], m[1])), data_frames),
    # Well-formed data ops with keys, the pool's block size and random data frames.
    st.tuples(st.tuples(st.sampled_from([P.PUT, P.GET, P.CONTAINS, P.REMOVE, P.RESERVE, P.ACQUIRE]),
                        st.integers(0, MAX_KEYS + 2))
              .map(lambda m: wire.encode_request(9, m[0], {"keys": b"f" * 16 * m[1], "block_bytes": BB})),
              data_frames),
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-fuzz")
    with PoolProcess(tmp, capacity="1MiB", block_bytes=BB, args=("--max-keys", str(MAX_KEYS))) as p:
        conn = connect(p.tcp, BB, transport="stream", timeout_s=5.0)
        src = blocks_for(PROBE, BB)
        assert all(conn.put(PROBE, np.uint64(src.data_ptr()) + np.arange(8, dtype=np.uint64) * np.uint64(BB)))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, p.tcp, None)  # the owner token of a keyless daemon of this user
        sock.connect(p.tcp)
        yield p, sock, conn, src
        sock.close()
        ctx.term()
        conn.close()
        assert p.alive(), "the pool died during the fuzz"
        assert "internal error" not in p.log(), p.log()[-3000:]


@given(request=requests, delimiter=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
def test_pool_survives_bad_requests_and_keeps_serving(daemon, request, delimiter):
    p, sock, conn, src = daemon
    envelope, data = request
    sock.send_multipart(([b""] if delimiter else []) + [envelope, *data])
    if sock.poll(3000):  # releases and commits marked noreply get no answer
        frames = sock.recv_multipart()
        envelope = next(f for f in frames if f)  # after the empty delimiter frame(s) the pool routed back
        rid, ok, body = wire.decode_reply(envelope, peer="the pool")
        if not ok:
            assert body["code"] in KNOWN_CODES, f"{body} for {envelope[:80]!r}"
            assert isinstance(body["message"], str) and body["message"]
    out = np.zeros((8, BB), np.uint8)
    hit = conn.get(PROBE, np.uint64(out.ctypes.data) + np.arange(8, dtype=np.uint64) * np.uint64(BB))
    assert_all_hits_exact(hit, out, src.numpy())


def test_oversized_batch_names_the_limit(daemon):
    p, sock, conn, src = daemon
    sock.send(wire.encode_request(3, P.CONTAINS, {"keys": b"k" * 16 * (MAX_KEYS + 1), "block_bytes": BB}))
    assert sock.poll(5000)
    rid, ok, body = wire.decode_reply(sock.recv_multipart()[-1], peer="the pool")
    assert not ok and body["code"] == wire.ERR_TOO_LARGE
    assert f"{MAX_KEYS + 1} keys in one batch, the limit is {MAX_KEYS}" in body["message"]


stream_requests = st.one_of(
    st.binary(max_size=300),  # not even a length prefix and envelope
    st.tuples(st.sampled_from([P.PUT, P.GET, P.STATS, "nope"]), bodies, st.binary(max_size=200))
    .map(lambda m: _framed(wire.encode_request(5, m[0], m[1])) + m[2]),
    st.tuples(st.sampled_from([P.PUT, P.GET]), st.integers(0, MAX_KEYS + 2), st.integers(0, 3 * BB))
    .map(lambda m: _framed(wire.encode_request(6, m[0], {"keys": b"s" * 16 * m[1], "block_bytes": BB}))
         + bytes(m[2])),
    st.integers(2**24, 2**32 - 1).map(lambda n: n.to_bytes(4, "little")),  # an absurd envelope length
)


def _framed(envelope: bytes) -> bytes:
    return len(envelope).to_bytes(4, "little") + envelope


@given(payload=stream_requests)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
def test_data_port_survives_garbage(daemon, payload):
    """Garbage on the raw data port: an error reply or a closed connection, and the pool goes on serving."""
    import socket

    p, sock, conn, src = daemon
    port = conn.info.transports["stream"]["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            raw.sendall(payload)
            raw.shutdown(socket.SHUT_WR)
            while raw.recv(1 << 16):
                pass
        except OSError:
            pass  # reset or closed by the pool (even before our shutdown): it gave up on this stream
    out = np.zeros((8, BB), np.uint8)
    hit = conn.get(PROBE, np.uint64(out.ctypes.data) + np.arange(8, dtype=np.uint64) * np.uint64(BB))
    assert_all_hits_exact(hit, out, src.numpy())
