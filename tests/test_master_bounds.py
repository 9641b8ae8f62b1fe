"""The master's memory is bounded whatever clients send (docs/reliability.md, "kvtier-master: memory"), through a
real kvtier-master subprocess and real sockets: every field has a size limit; the node table, the directory
locations and the hints have counts; dead nodes are forgotten after a grace period, also across a restart;
and replies a client never reads are held within a budget."""

from __future__ import annotations

import time
import urllib.request
import uuid

import numpy as np
import pytest
import zmq

from kvtier import wire
from kvtier.auth import secure_client
from kvtier.client import MasterClient, MasterError, MasterTimeout, api
from masterproc import MasterProcess
from poolproc import until
from zmtp import rss_bytes

MiB = 1 << 20


def tiers(n: int = 1) -> list[tuple[str, int]]:
    return [(f"t{i}", 1 << 30) for i in range(n)]


def metric(master: MasterProcess, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def refused(m: MasterClient, call: api.Call, field: str) -> None:
    with pytest.raises(MasterError) as e:
        m.call(call)
    assert e.value.code in (wire.ERR_TOO_LARGE, wire.ERR_BAD_REQUEST), e.value
    assert field in e.value.message, e.value.message


def test_every_field_a_client_sends_has_a_size_limit(tmp_path):
    with MasterProcess(tmp_path, lease_s=60.0) as master, MasterClient(master.endpoint, timeout_s=5.0) as m:
        before = rss_bytes(master.pid)
        big = "x" * 300_000
        refused(m, api.register("n", "i1", 0, tiers(), "tcp://h:1", {"role": big}), "labels")
        refused(m, api.register("n", "i1", 0, tiers(), "tcp://h:1", {big: "pool"}), "labels")
        refused(m, api.register("n", "i1", 0, tiers(), "tcp://h:1", {f"l{i}": "v" for i in range(1000)}), "labels")
        refused(m, api.register("n", "i1", 0, tiers(), "tcp://" + big), "address")
        refused(m, api.register(big, "i1", 0, tiers()), "node")
        refused(m, api.register("n", big, 0, tiers()), "incarnation")
        refused(m, api.register("n", "i1", 0, [(big, 1)]), "tiers")
        refused(m, api.register("n", "i1", 0, tiers(64)), "tiers")
        refused(m, api.pin(session=big, ttl_s=60), "session")
        refused(m, api.priority(3, session=big, ttl_s=60), "session")
        refused(m, api.cost([b"\0" * 16], [big], 16, 1e4), "candidates")
        refused(m, api.route_put([4096], requester=big), "requester")
        m.call(api.register("n", "i1", 0, tiers()))
        refused(m, api.heartbeat("n", "i1", 0, {}, {}, {f"peer-{i}": 1.0 for i in range(5000)}, 0.0), "path_bw")
        refused(m, api.heartbeat("n", "i1", 0, {}, {}, {big: 1.0}, 0.0), "path_bw")
        # A message larger than the master reads at all (a 200 MB label): zmq closes that connection unread.
        with MasterClient(master.endpoint, timeout_s=2.0) as huge:
            with pytest.raises(MasterTimeout):
                huge.call(api.register("n2", "i2", 0, tiers(), "", {"role": "y" * (200 * MiB)}))
        assert m.ping()["nodes"]["syncing"] == 1
        assert [(n["node"], n["labels"]) for n in m.nodes()] == [("n", {})]
        assert m.hints().session_pins == {}
        assert rss_bytes(master.pid) - before < 64 * MiB


def test_the_node_table_is_bounded_and_dead_nodes_make_room(tmp_path):
    with MasterProcess(tmp_path, lease_s=60.0) as master, MasterClient(master.endpoint, timeout_s=5.0) as m:
        incarnations = {}
        refusals = 0
        for i in range(1100):
            inc = uuid.uuid4().hex
            try:
                m.call(api.register(f"fake-{i}", inc, 0, tiers(), f"tcp://10.1.{i // 250}.{i % 250}:1",
                                    {"role": "pool"}))
                incarnations[f"fake-{i}"] = inc
            except MasterError as e:
                assert e.code == wire.ERR_TOO_LARGE and "--max-nodes" in e.message, e
                refusals += 1
        assert len(incarnations) == 1024 and refusals == 76
        assert len(m.nodes()) == 1024
        for name in ("fake-3", "fake-7"):  # two pools leave: their records may go to make room
            m.call(api.goodbye(name, incarnations[name]))
        m.call(api.register("new-a", uuid.uuid4().hex, 0, tiers()))
        m.call(api.register("new-b", uuid.uuid4().hex, 0, tiers()))
        names = {n["node"] for n in m.nodes()}
        assert len(names) == 1024 and {"new-a", "new-b"} <= names and not {"fake-3", "fake-7"} & names
        assert "forgetting dead node fake-3 early" in master.log()


def test_nodes_with_many_tiers_cannot_widen_every_directory_entry(tmp_path):
    """Each node tier is a bit in every directory entry's mask: 400 fake nodes of 8 tiers would make every
    entry of a 200K-key directory 400 B wider. The master numbers at most --max-locations (1024) of them."""
    keys = np.random.default_rng(3).integers(0, 2**63, size=(200_000, 2), dtype=np.uint64)
    with MasterProcess(tmp_path, lease_s=60.0) as master, MasterClient(master.endpoint, timeout_s=30.0) as m:
        m.call(api.register("real", "inc-real", 0, tiers()))
        for part in range(4):
            chunk = keys[part * 50_000:(part + 1) * 50_000]
            m.call(api.inventory("real", "inc-real", 0, part, part == 3, {"t0": chunk}, {"t0": 4096}))
        before = rss_bytes(master.pid)
        placed = refused_n = 0
        for i in range(400):
            node = f"wide-{i}"
            m.call(api.register(node, f"inc-{i}", 0, tiers(8)))
            try:
                m.call(api.inventory(node, f"inc-{i}", 0, 0, True, {"t0": keys[i:i + 1]}, {"t0": 4096}))
                placed += 1
            except MasterError as e:
                assert e.code == wire.ERR_TOO_LARGE and "--max-locations" in e.message, e
                refused_n += 1
        grown = rss_bytes(master.pid) - before
        assert placed == (1024 - 1) // 8 and refused_n == 400 - placed
        assert m.lookup(keys[:100]).any == 100  # the directory still answers
        assert grown < 120 * MiB, f"master RSS grew {grown / MiB:.0f} MiB"


@pytest.mark.slow  # two 5 s graces and two restarts
def test_dead_nodes_are_forgotten_after_the_grace_and_stay_forgotten_after_a_restart(tmp_path):
    data = tmp_path / "data"
    args = ("--forget-dead-s", "5")
    with MasterProcess(tmp_path, data_dir=data, lease_s=0.5, args=args) as master:
        with MasterClient(master.endpoint) as m:
            m.call(api.register("leaver", "inc-l", 0, tiers()))
            m.call(api.register("silent", "inc-s", 0, tiers()))
            m.call(api.goodbye("leaver", "inc-l"))
            assert until(lambda: sorted((n["node"], n["state"]) for n in m.nodes()) ==
                         [("leaver", "dead"), ("silent", "dead")], 5.0)
            assert until(lambda: m.nodes() == [], 10.0), m.nodes()
            m.call(api.register("late", "inc-x", 0, tiers()))
            m.call(api.goodbye("late", "inc-x"))
        assert master.terminate() == 0
        master.start()
        with MasterClient(master.endpoint) as m:
            assert [(n["node"], n["state"]) for n in m.nodes()] == [("late", "dead")]  # dead, not back as pending
            assert until(lambda: m.nodes() == [], 10.0)
        assert master.terminate() == 0
        master.start()
        with MasterClient(master.endpoint) as m:
            assert m.nodes() == []


def test_a_node_that_left_does_not_come_back_after_a_restart(tmp_path):
    """With the default grace (an hour): a node that said goodbye is dead after a restart, never pending (a
    pending node is one the master waits for and answers route_put with, once it heartbeats)."""
    with MasterProcess(tmp_path, data_dir=tmp_path / "data", lease_s=5.0) as master:
        with MasterClient(master.endpoint) as m:
            m.call(api.register("gone", "inc-g", 0, tiers()))
            m.call(api.inventory("gone", "inc-g", 0, 0, True, {"t0": b"\1" * 16}, {"t0": 4096}))
            time.sleep(0.5)  # a few ticks: its record is on disk as a live node's
            m.call(api.goodbye("gone", "inc-g"))
        assert master.terminate() == 0
        master.start()
        with MasterClient(master.endpoint) as m:
            assert [(n["node"], n["state"]) for n in m.nodes()] == [("gone", "dead")]
            assert m.ping()["nodes"]["pending"] == 0


@pytest.mark.slow  # a memory stress: 700 replies of 0.8 MB
def test_replies_a_client_never_reads_stay_within_the_budget(tmp_path):
    """700 `top` replies of ~0.8 MB each, asked for and never read (the old master held all of them: 540 MB);
    the master keeps at most its 256 MiB reply budget of them, answers the rest with a short 'busy', and serves
    everyone else meanwhile."""
    keys = np.random.default_rng(5).integers(0, 2**63, size=(25_000, 2), dtype=np.uint64)
    with MasterProcess(tmp_path, lease_s=60.0) as master, MasterClient(master.endpoint, timeout_s=10.0) as m:
        m.call(api.register("n", "inc", 0, tiers()))
        m.call(api.inventory("n", "inc", 0, 0, True, {"t0": keys}, {"t0": 4096}))
        m.lookup(keys)  # heat: top() has scores to rank
        reply = len(wire.encode_reply(1, True, {"keys": b"\0" * 16 * 25_000, "heat": [0.5] * 25_000,
                                                "count": [1] * 25_000, "last": [1 << 30] * 25_000}))
        assert reply > 700_000
        before = rss_bytes(master.pid)
        ctx = zmq.Context()
        deaf = ctx.socket(zmq.DEALER)
        deaf.setsockopt(zmq.RCVHWM, 1)  # this client reads nothing: zmq and the kernel buffer little for it
        deaf.setsockopt(zmq.RCVBUF, 4096)
        secure_client(deaf, master.endpoint, None)  # the owner token of a keyless daemon of this user
        deaf.connect(master.endpoint)
        try:
            for i in range(700):
                deaf.send(wire.encode_request(i + 1, wire.TOP, {"n": 25_000}))
            assert until(lambda: metric(master, "kvtier_master_requests_total", 'op="top"') >= 700, 60.0)
            t0 = time.perf_counter()
            assert m.ping()["version"] == wire.VERSION and time.perf_counter() - t0 < 2.0
            grown = rss_bytes(master.pid) - before
            assert grown < 330 * MiB, f"master RSS grew {grown / MiB:.0f} MiB for replies nobody reads"
            assert metric(master, "kvtier_master_replies_dropped_total", 'reason="budget"') > 0
            assert metric(master, "kvtier_master_unsent_reply_bytes") <= 256 * MiB + reply
        finally:
            deaf.close(linger=0)
            ctx.term()
