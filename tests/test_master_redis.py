"""Several kvtier-masters sharing one directory in a real redis-server (``--directory redis://``), all real
processes and sockets: what one master accepts every master answers; kill -9 of any master mid-traffic gives
no wrong answer and no lookup failing longer than the client's failover; a restarted or new master answers
correctly before it accepts requests; a dead node vanishes from every master within a lease; Redis killed
(with its data, or losing it) leaves the masters serving read-only, and they recover after."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import TieredStore, wire
from kvtier.client import AsyncMasterClient, MasterClient, MasterError, NodeAgent, api
from masterproc import MasterProcess
from poolproc import wait_for
from redisproc import RedisProcess, needs_redis

pytestmark = needs_redis
BB = 4096


def metric(master: MasterProcess, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and labels in line and not line.startswith("#"))


@contextlib.contextmanager
def masters(tmp_path, redis: RedisProcess, n: int, lease_s: float = 5.0,
            args: tuple = ()) -> Iterator[list[MasterProcess]]:
    """``n`` masters sharing ``redis``, each in its own directory; on leaving, every one in the list (a test may
    kill, restart or add one in between) is killed -9, also when one of them failed to start."""
    out: list[MasterProcess] = []
    try:
        for i in range(n):
            d = tmp_path / f"m{i}"
            d.mkdir(exist_ok=True)
            out.append(MasterProcess(d, lease_s=lease_s, args=("--directory", redis.url, *args)).start())
        yield out
    finally:
        for m in out:
            m.kill()


def endpoints(ms: list[MasterProcess]) -> str:
    return ",".join(m.endpoint for m in ms)


def node_store(master: str, name: str, keys, timeout_s: float = 0.5, **kw):
    s = TieredStore.from_config({"dram_capacity": 4096 * BB}, BB)
    agent = NodeAgent.for_store(s, master, name, timeout_s=timeout_s, **kw).start()
    if keys:
        s.put(keys, blocks_for(keys, BB))
    assert agent.wait_synced(20.0)
    return s, agent


@pytest.fixture
def redis(tmp_path):
    with RedisProcess(tmp_path) as r:
        yield r


def test_what_one_master_accepts_every_master_answers(tmp_path, redis, make_keys):
    with masters(tmp_path, redis, 3) as ms:
        keys = make_keys(40)
        s, agent = node_store(ms[0].endpoint, "w1", keys)
        clients = [MasterClient(m.endpoint) for m in ms]
        # The node's events went to master 0; every master holds the same directory once it applied them.
        for c in clients:
            assert wait_for(lambda c=c: c.lookup(keys, touch=False).for_node("w1").get("dram") == 40)
        assert clients[1].pin(session="agent-1", ttl_s=60) == 1  # a hint set on master 1 ...
        versions = {wait_for(lambda c=c: c.hints().session_pins and c.hints().version) for c in clients}
        assert len(versions) == 1  # ... is the same hint table, same version, on all of them
        assert {tuple(sorted(c.hints().session_pins)) for c in clients} == {("agent-1",)}
        # Heat counted by lookups on master 2 reaches the others (logged as sums once a second).
        for _ in range(5):
            clients[2].lookup(keys[:10])
        assert wait_for(lambda: min(clients[0].heat(keys[:10]).count) == 5, 10.0)
        assert clients[1].heat(keys[10:]).count == [0] * 30
        # A write refused by the log's apply is refused the same way through any master.
        for c in clients:
            with pytest.raises(MasterError) as e:
                c.call(api.register("w1", "another-incarnation", 0, [("dram", 1 << 20)]))
            assert e.value.code == wire.ERR_NODE_OWNED
        assert {m.ping()["backend"]["state"] for m in clients} == {"ok"}
        assert len({m.ping()["backend"]["epoch"] for m in clients}) == 1
        agent.close()
        s.close()
        for c in clients:
            c.close()


@pytest.mark.slow  # a crash loop: each master killed in turn
def test_kill9_of_any_master_mid_traffic_no_wrong_answer_no_long_failure(tmp_path, redis, make_keys):
    """A node writes a growing prefix through the masters while readers look it up through all three; each
    master is killed in turn (and restarted). A lookup may trail the writer (bounded staleness) but never names
    a block the node has not stored, and no lookup fails: a call to a dead master fails over to the next
    within the client's timeout."""
    with masters(tmp_path, redis, 3) as ms:
        timeout_s = 0.5
        keys = make_keys(600)
        stored = [0]  # leading keys the node has stored and the master acknowledged (the agent synced)
        issued = [10]  # leading keys the node was asked to store (the master may know them before the ack)
        stop = threading.Event()
        results: list[tuple[float, float, int, int]] = []  # (start, latency, any, stored when it began)
        failures: list[tuple[float, str]] = []
        s, agent = node_store(endpoints(ms), "writer", keys[:10], timeout_s=timeout_s)
        stored[0] = 10

        def write() -> None:
            n = 10
            while not stop.is_set() and n < len(keys):
                issued[0] = n + 10
                s.put(keys[n : n + 10], blocks_for(keys[n : n + 10], BB))
                if agent.wait_synced(10.0):
                    n += 10
                    stored[0] = n

        def read() -> None:
            with MasterClient(endpoints(ms), timeout_s=timeout_s) as c:
                while not stop.is_set():
                    t0 = time.monotonic()
                    before = stored[0]
                    try:
                        got = c.lookup(keys, touch=False)
                    except MasterError as e:
                        failures.append((t0, str(e)))
                        continue
                    results.append((t0, time.monotonic() - t0, got.any, before))
                    # Never a block the node was not asked to store (read after the answer came).
                    assert got.any <= issued[0], (got.any, issued[0])
                    assert {h.node for h in got.hits} <= {"writer"}

        threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for victim in range(3):
                wait_for(lambda: stored[0] >= 100 + 150 * victim, 60.0, "the writer to make progress")
                ms[victim].kill()
                time.sleep(1.5)  # traffic goes on against the other two
                ms[victim].start()  # back on its endpoint: it loaded the snapshot and the log before binding
                with MasterClient(ms[victim].endpoint, timeout_s=5.0) as fresh:
                    # Its first answer is already current: it trails the node by at most what is in flight.
                    acked = stored[0]
                    first = fresh.lookup(keys, touch=False).any
                    assert acked - 20 <= first <= issued[0], (acked, first, issued[0])
            wait_for(lambda: stored[0] >= 550, 60.0, "the writer to finish")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not failures, failures[:5]
        assert len(results) > 100
        worst = max(lat for _, lat, _, _ in results)
        # A lookup caught by a kill waits out one timeout on the dead master, then the next answers.
        assert worst < timeout_s + 1.5, worst
        # The reader saw the prefix grow (no master was stuck at an old view after it came back).
        assert max(a for _, _, a, _ in results) >= 500
        with MasterClient(endpoints(ms)) as c:
            final = {m.endpoint: MasterClient(m.endpoint).lookup(keys, touch=False).any for m in ms}
            assert set(final.values()) == {stored[0]}, final
            assert c.failover.failovers >= 0
        agent.close()
        s.close()


def test_a_dead_node_vanishes_from_every_master_within_one_lease(tmp_path, redis, make_keys):
    lease = 2.0
    with masters(tmp_path, redis, 3, lease_s=lease) as ms:
        keys = make_keys(8)
        with MasterClient(ms[0].endpoint) as m0:
            m0.call(api.register("gone", "inc", 0, [("dram", 1 << 30)]))
            m0.call(api.inventory("gone", "inc", 0, 0, True, {"dram": keys}, {"dram": BB}))
            last_heard = time.monotonic()
        clients = [MasterClient(m.endpoint) for m in ms]
        for c in clients:
            assert wait_for(lambda c=c: c.lookup(keys, touch=False).any == 8)
        dead_at = []
        for c in clients:
            wait_for(lambda c=c: c.lookup(keys, touch=False).any == 0, lease + 5.0, "the node's death")
            dead_at.append(time.monotonic() - last_heard)
        # Within a lease (plus the timer's tick and the log's delivery), on every master.
        assert max(dead_at) < lease + 1.0, dead_at
        assert all(n["state"] == "dead" for c in clients for n in c.nodes())
        for c in clients:
            c.close()


def test_masters_with_other_settings_refuse_to_join(tmp_path, redis):
    with masters(tmp_path, redis, 1, args=("--max-nodes", "50")) as ms:
        r = subprocess.run([sys.executable, "-m", "kvtier.master", "--bind", "tcp://127.0.0.1:*", "--metrics-port",
                            "-1", "--directory", redis.url, "--max-nodes", "60"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "--max-nodes 60 here, 50 in the cluster" in r.stderr, r.stderr
        r = subprocess.run([sys.executable, "-m", "kvtier.master", "--directory", "http://x", "--metrics-port", "-1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "redis://" in r.stderr


def test_a_new_master_loads_the_snapshot_replays_the_log_and_the_log_is_trimmed(tmp_path, redis, make_keys):
    import redis as redis_py

    keys = make_keys(300)
    with masters(tmp_path, redis, 1, lease_s=30.0, args=("--snapshot-interval-s", "0.5")) as ms:
        with MasterClient(ms[0].endpoint) as m:
            m.call(api.register("n", "inc", 0, [("dram", 1 << 30)]))
            m.call(api.inventory("n", "inc", 0, 0, True, {"dram": keys[:100]}, {"dram": BB}))
            seq = 0
            for i in range(100, 300, 5):
                seq += 1
                m.call(api.events("n", "inc", seq, [(wire.ADD, "dram", keys[i : i + 5], BB)]))
                m.call(api.heartbeat("n", "inc", seq, {}, {}, {}, 0.0))
            r = redis_py.Redis.from_url(redis.url)
            wait_for(lambda: int(r.get("kvtier:n")) > 80 and r.xlen("kvtier:log") < 20, 20.0, "a snapshot and a trim")
            assert "shared snapshot at entry" in ms[0].log()
            more = tmp_path / "late"
            more.mkdir()
            late = MasterProcess(more, lease_s=30.0, args=("--directory", redis.url)).start()
            ms.append(late)
            assert "snapshot at entry" in late.log()
            with MasterClient(late.endpoint) as c:
                assert c.lookup(keys, touch=False).any == 300  # snapshot + the entries after it, before serving
                assert [n["applied_seq"] for n in c.nodes()] == [seq]
            r.close()


@pytest.mark.slow  # a crash test: Redis killed under the masters
def test_redis_killed_masters_serve_read_only_then_recover(tmp_path, redis, make_keys):
    # Every client, agent and store is closed by the ExitStack, failing or not: one left open on a failure held
    # zmq's context until a later test hung in its teardown.
    with masters(tmp_path, redis, 2, lease_s=3.0) as ms, contextlib.ExitStack() as closing:
        keys = make_keys(30)
        s, agent = node_store(endpoints(ms), "w1", keys[:20])
        closing.callback(s.close)
        closing.callback(agent.close)  # (callbacks run last first: clients, the agent, then the store)
        clients = [closing.enter_context(MasterClient(m.endpoint, timeout_s=3.0)) for m in ms]
        for c in clients:
            wait_for(lambda c=c: c.lookup(keys, touch=False).any == 20)
        redis.kill()
        for m, c in zip(ms, clients):
            # Reads: the masters' views, as they were.
            assert c.lookup(keys, touch=False).any == 20
            # A write racing the kill: if the master has not yet seen Redis go, its append fails on the dead
            # connection and it cannot know whether Redis took the entry first, so both answers are honest ...
            with pytest.raises(MasterError) as e:
                c.pin(session="during", ttl_s=60)
            assert e.value.code == wire.ERR_UNAVAILABLE
            assert "nothing was recorded" in e.value.message or "it may have been recorded" in e.value.message
            wait_for(lambda m=m: metric(m, "kvtier_master_backend_state", 'state="read_only"') == 1.0, 10.0)
            assert "directory READ-ONLY" in m.log()
            # ... once read-only, the master refuses before logging: nothing was recorded.
            with pytest.raises(MasterError) as e:
                c.pin(session="during", ttl_s=60)
            assert e.value.code == wire.ERR_UNAVAILABLE and "nothing was recorded" in e.value.message
        s.put(keys[20:], blocks_for(keys[20:], BB))  # the node's events are refused meanwhile ...
        time.sleep(4.0)  # ... longer than a lease: nobody can log a death, so the node is not declared dead
        assert clients[0].lookup(keys, touch=False).any == 20
        redis.start()  # with its data (append-only file)
        for m, c in zip(ms, clients):
            wait_for(lambda c=c: c.ping()["backend"]["state"] == "ok", 20.0, "the master writable again")
            assert "directory writable again" in m.log()
        # ... and it resyncs (its sequence numbers told), so both masters have all 30 blocks.
        assert agent.wait_synced(20.0)
        for c in clients:
            wait_for(lambda c=c: c.lookup(keys, touch=False).any == 30, 20.0)
        assert clients[1].pin(session="after", ttl_s=60) == 1
        wait_for(lambda: "after" in clients[0].hints().session_pins)
        assert agent.counters["inventories"] >= 2


def backend_state(m) -> str:
    with MasterClient(m.endpoint) as c:
        return c.ping()["backend"]["state"]


def test_redis_restarted_without_its_data_is_reseeded_by_a_master(tmp_path, make_keys):
    with RedisProcess(tmp_path, persist=False) as redis:
        with masters(tmp_path, redis, 2, lease_s=5.0) as ms:
            keys = make_keys(25)
            s, agent = node_store(endpoints(ms), "w1", keys)
            with MasterClient(ms[1].endpoint) as c:
                wait_for(lambda: c.lookup(keys, touch=False).any == 25)
                c.pin(session="kept", ttl_s=600)
            redis.kill()
            redis.start()  # empty: no epoch, no log
            with MasterClient(endpoints(ms), timeout_s=3.0) as c:
                wait_for(lambda: all(backend_state(m) == "ok" for m in ms), 20.0)
                logs = ms[0].log() + ms[1].log()
                assert logs.count("kvtier-master: seeded redis") == 2  # the first start, and the re-seed by one master
                # The re-seeding master's view is the cluster's now: hints survived Redis's loss, and the blocks
                # are listed again once the node resynced (a re-seed is a new epoch: every node sends an inventory).
                for m in ms:
                    with MasterClient(m.endpoint) as one:
                        wait_for(lambda one=one: one.lookup(keys, touch=False).any == 25)
                        assert "kept" in one.hints().session_pins
                s.put(make_keys(5, start=1000), blocks_for(make_keys(5, start=1000), BB))
                assert agent.wait_synced(20.0)
                wait_for(lambda: c.lookup(make_keys(5, start=1000), touch=False).any == 5)
            agent.close()
            s.close()


def test_clients_fail_over_from_a_master_that_does_not_answer(tmp_path, redis):
    import asyncio
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{sk.getsockname()[1]}"  # nothing listens there
    with masters(tmp_path, redis, 1) as ms:
        with MasterClient([dead, ms[0].endpoint], timeout_s=0.3) as c:
            t0 = time.monotonic()
            assert c.ping()["version"] == wire.VERSION
            assert 0.25 < time.monotonic() - t0 < 2.0  # one timeout on the dead one, then the live one
            assert c.endpoint == ms[0].endpoint and c.failover.failovers == 1
            t0 = time.monotonic()
            for _ in range(20):
                c.ping()
            assert time.monotonic() - t0 < 1.0  # the dead master is not asked again while in its back-off

        async def run() -> None:
            async with AsyncMasterClient(f"{dead},{ms[0].endpoint}", timeout_s=0.3) as a:
                pongs = await asyncio.gather(*(a.ping() for _ in range(5)))
                assert all(p["version"] == wire.VERSION for p in pongs)
                assert a.endpoint == ms[0].endpoint

        asyncio.run(run())
        with MasterClient(dead, timeout_s=0.2) as alone:
            with pytest.raises(MasterError):
                alone.ping()


@pytest.mark.slow  # a crash test over three masters
def test_a_pool_and_a_distributed_store_take_the_master_list_and_survive_a_masters_death(tmp_path, redis, make_keys):
    """kvtier-pool --master A,B and the store's ``master`` config key (what the connectors pass) with two masters:
    the master both were using is killed -9; the pool keeps its lease through the other, and another store
    still finds and reads the blocks."""
    from poolproc import PoolProcess
    import torch

    pool_bb = 16 << 10
    with masters(tmp_path, redis, 2, lease_s=3.0) as ms:
        both = endpoints(ms)
        with PoolProcess(tmp_path, name="pl", capacity="4MiB", block_bytes=pool_bb, master=both,
                         args=("--heartbeat-s", "0.2")) as pool:
            with MasterClient(both) as m:
                wait_for(lambda: [n["state"] for n in m.nodes()] == ["live"], 15.0, "the pool live")
            cfg = {"mode": "distributed", "master": both, "dram_capacity": 4 * pool_bb, "pool_timeout_ms": 500}
            keys = make_keys(20, start=7000)
            with TieredStore.from_config({**cfg, "node_id": "e1"}, pool_bb) as w:
                w.put(keys, blocks_for(keys, pool_bb))
                assert w.flush(10.0)
            with MasterClient(ms[1].endpoint) as m1:
                wait_for(lambda: m1.lookup(keys, touch=False).any == 20)
            ms[0].kill()  # the first in both lists: the one the pool's agent and the stores used
            time.sleep(4.0)  # longer than a lease: the pool's heartbeats went to the other master
            with MasterClient(ms[1].endpoint) as m1:
                assert [n["state"] for n in m1.nodes()] == ["live"]
            with TieredStore.from_config({**cfg, "node_id": "e2"}, pool_bb) as r:
                out = torch.zeros(20, pool_bb, dtype=torch.uint8)
                assert_all_hits_exact(r.get(keys, out), out, blocks_for(keys, pool_bb))
            assert pool.alive()
