"""``kvtier status`` against a master that answers garbage (issue 23, 5): one line naming the master and the
field that was wrong, a non-zero exit, never a traceback.

The master here is a fake on a real zmq ROUTER socket speaking the master's wire protocol (kvtier.wire): a
real master never answers malformed replies, and what is under test is the client's reading of them. The
command runs as a subprocess for the named cases; hypothesis mutates a valid answer (a field dropped, or
replaced by a value of another type, an infinite or huge one) and runs the same code in-process.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import threading
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.auth import forget_tokens
from kvtier.client.master import MasterError
from kvtier.keys import Namespace
from kvtier.tools.status import EXIT_MALFORMED, gather, render
from kvtier.tools.status_shape import MalformedStatus

KEYS = Namespace("status-malformed").keys(range(3))
NOW = 1_760_000_000.0

# What a real master answers (the shapes of master/ops_router.py's ping, nodes and top), as bodies per op.
VALID: dict[str, Any] = {
    wire.PING: {"uptime_s": 12.5, "lease_s": 10.0, "keys": 3, "directory_bytes": 4096, "locations": 2,
                "backend": {"kind": "lmdb"}, "nodes": {"live": 1, "dead": 1},
                "activity": {"lookups": {"count": 4, "keys": 10, "hits": 7, "misses": 3},
                             "requests": {"lookup": {"ok": 4, "bad_request": 1}},
                             "recent_errors": [{"at": NOW, "op": "lookup", "code": "bad_request", "message": "x"}]}},
    wire.NODES: {"nodes": [{"node": "pool-a", "state": "live", "address": "tcp://a:1", "silent_s": 0.2,
                            "rpc_latency_s": 0.0004, "labels": {"dram_pages": "2 MiB"},
                            "tiers": [{"name": "dram", "capacity": 1 << 20, "used": 1 << 19, "bw": 6.7e9}]},
                           {"node": "pool-b", "state": "dead", "address": None, "silent_s": 30.0,
                            "rpc_latency_s": None, "tiers": []}]},
    wire.TOP: {"keys": wire.pack_keys(KEYS), "heat": [3.0, 2.0, 1.0], "count": [3, 2, 1], "last": [NOW, NOW, 0]},
}


class FakeMaster:
    """A ROUTER socket on a free loopback port answering each op with ``answers[op]``: a body (sent as an ok
    reply) or bytes (sent as the whole frame, whatever it is)."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = copy.deepcopy(VALID)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        forget_tokens([self.endpoint])  # as a NULL daemon does: a killed pool's token on this port means PLAIN
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, frame = self._sock.recv_multipart()
            req_id, op, _body = wire.decode_request(frame)
            answer = self.answers.get(op, {})
            reply = answer if isinstance(answer, bytes) else wire.encode_reply(req_id, True, answer)
            self._sock.send_multipart([ident, reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


@pytest.fixture
def fake():
    f = FakeMaster()
    yield f
    f.close()


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "status", *args], capture_output=True, text=True,
                          timeout=60)


def test_the_fake_answers_like_a_master_negative_control(fake):
    """The valid answers render: what the malformed cases refuse is the malformation, not the fake."""
    r = status("--master", fake.endpoint)
    assert r.returncode == 0, r.stderr
    assert "pool-a" in r.stdout and "7 hits, 3 misses" in r.stdout and KEYS[0].hex() in r.stdout


def _broken(op: str, path: tuple, value: Any = ...) -> dict:
    """VALID with ``path`` of ``op``'s answer removed (value ...) or replaced by ``value``."""
    answers = copy.deepcopy(VALID)
    *parent, last = path
    where = answers[op]
    for step in parent:
        where = where[step]
    if value is ...:
        del where[last]
    else:
        where[last] = value
    return answers


CASES = [  # (answers, what the one line must name)
    (_broken(wire.NODES, ("nodes",)), "nodes: malformed reply"),  # the SDK's own parse: KeyError before
    (_broken(wire.NODES, ("nodes", 0, "state")), "nodes[0].state: missing"),
    (_broken(wire.NODES, ("nodes", 0, "tiers", 0, "capacity"), "1 MiB"), "nodes[0].tiers[0].capacity: expected a "
                                                                          "count"),
    (_broken(wire.NODES, ("nodes",), {"pool-a": "live"}), "nodes: expected an array"),
    (_broken(wire.NODES, ("nodes", 0, "labels"), ["dram_pages"]), "nodes[0].labels: expected a map"),
    (_broken(wire.NODES, ("nodes", 0, "labels", "dram_pages"), 2), "nodes[0].labels.dram_pages: expected a string"),
    (_broken(wire.PING, ("uptime_s",), math.inf), "ping.uptime_s: expected seconds"),
    (_broken(wire.PING, ("activity", "recent_errors", 0, "at"), 1e300), "ping.activity.recent_errors[0].at"),
    (_broken(wire.PING, ("activity", "lookups", "hits"), [7]), "ping.activity.lookups.hits"),
    (_broken(wire.TOP, ("heat",), ["hot", 2.0, 1.0]), "top.heat[0]: expected a finite number"),
    (_broken(wire.TOP, ("count",), [3]), "top: arrays of different lengths"),
    ({**VALID, wire.PING: b"\x93not a reply"}, "malformed status"),  # not even msgpack
]


@pytest.mark.parametrize("answers, named", CASES, ids=[n for _, n in CASES])
def test_status_names_the_master_and_the_field_and_exits_non_zero(fake, answers, named):
    fake.answers = answers
    r = status("--master", fake.endpoint)
    assert r.returncode == EXIT_MALFORMED, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"kvtier status: master {fake.endpoint} answered a malformed status: ")
    assert named in lines[0], lines[0]


def test_json_output_refuses_the_same(fake):
    fake.answers = CASES[1][0]
    r = status("--master", fake.endpoint, "--json")
    assert r.returncode == EXIT_MALFORMED and "nodes[0].state: missing" in r.stderr and r.stdout == ""


# ---- any malformation: refused cleanly, or rendered --------------------------------------------------------

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=40),
    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3),
    st.just("x" * 1_000_000), st.just(2**64 - 1), st.just(-1e308),
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a reply a mutation can hit: map fields and array items, nested."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


PLACES = [(op, path) for op in VALID for path in _paths(VALID[op])]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(PLACES), delete=st.booleans(), junk=JUNK)
def test_any_malformed_answer_is_refused_by_name_or_rendered(fake, place, delete, junk):
    op, path = place
    fake.answers = _broken(op, path) if delete else _broken(op, path, junk)
    try:
        data = gather(fake.endpoint, top=3, timeout_s=5.0)
    except MalformedStatus as e:
        assert e.master == fake.endpoint and e.where
        return
    except MasterError as e:
        assert e.code == wire.ERR_BAD_MESSAGE and fake.endpoint in str(e), e
        return
    # Accepted: the screen and the JSON render whatever it was (a field the screen does not read, or a value
    # of the right kind).
    assert render(data)
    json.dumps(data, default=str)


def test_a_huge_but_well_typed_answer_renders(fake):
    """Huge values of the right type are not malformed: a 1 MB node name, 2**64 - 1 bytes used."""
    fake.answers = _broken(wire.NODES, ("nodes", 0, "node"), "n" * 1_000_000)
    fake.answers[wire.NODES]["nodes"][0]["tiers"][0]["used"] = 2**64 - 1
    r = status("--master", fake.endpoint)
    assert r.returncode == 0, r.stderr
    assert "n" * 21 in r.stdout and len(r.stdout) < 10_000


def test_the_sdk_names_a_malformed_reply_for_every_caller(fake):
    """The SDK itself: a reply without the fields an op answers is MasterError bad_message naming the master
    (here top's keys missing), not a KeyError from inside the parse."""
    from kvtier.client import MasterClient

    fake.answers = _broken(wire.TOP, ("keys",))
    with MasterClient(fake.endpoint, timeout_s=5.0) as m, pytest.raises(MasterError) as e:
        m.top(3)
    assert e.value.code == wire.ERR_BAD_MESSAGE and f"top: malformed reply from {fake.endpoint}" in str(e.value)


def test_the_async_sdk_names_a_malformed_reply_too(fake):
    import asyncio

    from kvtier.client import AsyncMasterClient

    async def nodes() -> None:
        async with AsyncMasterClient(fake.endpoint, timeout_s=5.0) as m:
            await m.nodes()

    fake.answers = _broken(wire.NODES, ("nodes",))
    with pytest.raises(MasterError) as e:
        asyncio.run(nodes())
    assert e.value.code == wire.ERR_BAD_MESSAGE and f"nodes: malformed reply from {fake.endpoint}" in str(e.value)


def test_one_malformed_master_of_several_is_shown_on_its_row(fake):
    """With several masters, one answering garbage is flagged on its own row; the others' view is shown."""
    good = FakeMaster()
    try:
        fake.answers = _broken(wire.PING, ("uptime_s",), "soon")
        data = gather(f"{good.endpoint},{fake.endpoint}", top=3, timeout_s=5.0)
        rows = {m["endpoint"]: m for m in data["masters"]}
        assert rows[good.endpoint]["up"] and not rows[fake.endpoint]["up"]
        assert "ping.uptime_s: expected seconds" in rows[fake.endpoint]["error"]
        assert data["master"] == good.endpoint and "pool-a" in render(data)
    finally:
        good.close()
