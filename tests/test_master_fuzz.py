"""Hypothesis throws malformed, mistyped, unknown and oversized requests at a running kvtier-master; every one
gets an error reply that names the problem (never ERR_INTERNAL), and after each the daemon still answers a
known lookup correctly."""

import uuid

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.auth import secure_client
from kvtier.client import MasterClient, MasterError
from kvtier.client import api
from kvtier.keys import Namespace
from masterproc import MasterProcess

MAX_KEYS = 1000
PROBE = Namespace("fuzz-probe").keys(range(20))
KNOWN_CODES = {wire.ERR_BAD_MESSAGE, wire.ERR_BAD_VERSION, wire.ERR_UNKNOWN_OP, wire.ERR_BAD_REQUEST,
               wire.ERR_TOO_LARGE, wire.ERR_UNKNOWN_NODE}
FIELDS = ["keys", "touch", "candidates", "model", "sizes", "requester", "policy", "n", "session", "ttl_s", "level",
          "since", "node", "incarnation", "seq", "tiers", "labels", "used", "bw", "path_bw", "rpc_latency_s",
          "events", "part", "last", "block_bytes", "address", "block_tokens", "prefill_tokens_per_s"]
OPS = sorted({wire.PING, wire.LOOKUP, wire.COST, wire.ROUTE_PUT, wire.HEAT, wire.TOP, wire.NODES, wire.PIN,
              wire.UNPIN, wire.PRIORITY, wire.HINTS, wire.LOCATE, wire.REGISTER, wire.HEARTBEAT, wire.EVENTS,
              wire.INVENTORY, wire.GOODBYE, wire.PREFETCH})

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.binary(max_size=48))
key_blobs = st.sampled_from([0, 1, 3, 1000, 1001, 4000]).map(lambda n: b"k" * 16 * n) | \
    st.integers(0, 100).map(lambda n: b"x" * n)
values = st.recursive(scalars | key_blobs, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4),
                      max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)


def packed(obj):
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc1"  # not encodable: send the reserved byte instead (still garbage)


requests = st.one_of(
    st.binary(max_size=200),  # not msgpack at all, or msgpack of anything
    values.map(packed),
    st.tuples(st.sampled_from([1, 0, 2, "1", None]), st.integers(0, 2**32) | scalars,
              st.sampled_from(OPS) | st.text(max_size=12) | scalars, bodies | values).map(lambda m: packed(list(m))),
    st.tuples(st.sampled_from(OPS), bodies).map(lambda m: wire.encode_request(7, m[0], m[1])),
    # Node ops from a registered node ("fz"), so the checks past the node lookup get exercised too.
    st.tuples(st.sampled_from([wire.HEARTBEAT, wire.EVENTS, wire.INVENTORY, wire.REGISTER]), bodies,
              st.lists(st.tuples(st.sampled_from([0, 1, 2, True]), st.sampled_from(["dram", "ssd", 3]),
                                 key_blobs, st.integers(-1, 2**33)).map(list), max_size=3))
    .map(lambda m: wire.encode_request(9, m[0], {**m[1], "node": "fz", "incarnation": "inc", "events": m[2]})),
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    with MasterProcess(tmp, data_dir=tmp / "data", lease_s=120.0,
                       args=("--max-batch-keys", str(MAX_KEYS))) as mp:
        node = "probe-" + uuid.uuid4().hex
        with MasterClient(mp.endpoint) as m:
            m.call(api.register(node, "inc", 0, [("dram", 1 << 30)]))
            m.call(api.inventory(node, "inc", 0, 0, True, {"dram": PROBE}, {"dram": 4096}))
            m.call(api.register("fz", "inc", 0, [("dram", 1 << 30)]))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, mp.endpoint, None)  # the owner token of a keyless daemon of this user
        sock.connect(mp.endpoint)
        yield mp, sock, node
        sock.close()
        ctx.term()
        assert mp.alive(), "the daemon died during the fuzz"


@given(frame=requests, delimiter=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
def test_daemon_survives_bad_requests_and_keeps_answering(daemon, frame, delimiter):
    mp, sock, node = daemon
    sock.send_multipart([b"", frame] if delimiter else [frame])
    assert sock.poll(5000), f"no reply to {frame[:60]!r}"
    reply = sock.recv_multipart()[-1]
    rid, ok, body = wire.decode_reply(reply)
    if not ok:
        assert body["code"] in KNOWN_CODES, f"{body} for {frame[:80]!r}"
        assert isinstance(body["message"], str) and body["message"]
    # The daemon still answers correctly.
    probe = wire.encode_request(2**40, wire.LOOKUP, {"keys": b"".join(PROBE), "touch": False})
    sock.send(probe)
    assert sock.poll(5000)
    rid, ok, body = wire.decode_reply(sock.recv_multipart()[-1])
    assert ok and rid == 2**40 and body["any"] == 20 and [node, "dram", 20] in body["prefix"]


def test_oversized_batch_names_the_limit(daemon):
    mp, sock, node = daemon
    with MasterClient(mp.endpoint) as m:
        with pytest.raises(MasterError) as e:
            m.lookup(PROBE * 51)  # 1020 keys > 1000
        assert e.value.code == wire.ERR_TOO_LARGE and "1020 keys in one batch, the limit is 1000" in str(e.value)
        assert m.lookup(PROBE).any == 20


def test_wrong_version_is_named(daemon):
    mp, sock, node = daemon
    sock.send(msgpack.packb([99, 5, "ping", {}]))
    assert sock.poll(5000)
    rid, ok, body = wire.decode_reply(sock.recv_multipart()[-1])
    assert not ok and rid == 5 and body["code"] == wire.ERR_BAD_VERSION
    assert "version 99 is not supported" in body["message"]
