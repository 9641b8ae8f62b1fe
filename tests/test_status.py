"""``kvtier status`` against a real cluster: a kvtier-master subprocess, a kvtier-pool subprocess registered
with it, and an engine-like node (a TieredStore published by a NodeAgent) whose keys the master's lookups
hit; the command itself runs as a subprocess, as an operator would run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import blocks_for
from masterproc import MasterProcess
from poolproc import PoolProcess, wait_for

from kvtier import TieredStore
from kvtier.client import MasterClient, NodeAgent
from kvtier.client.master import MasterError
from kvtier.keys import Namespace
from kvtier.tools.status import render

BB = 4096
KEYS = Namespace("status-test").keys(range(64))


def status(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", "status", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "120"})


@pytest.fixture
def cluster(tmp_path):
    with MasterProcess(tmp_path, lease_s=2.0) as master, \
            PoolProcess(tmp_path, capacity="8MiB", master=master.endpoint, block_bytes=BB, name="pool-a",
                        args=("--node-id", "pool-a")) as pool:
        store = TieredStore.from_config({"dram_capacity": 256 * BB}, BB)
        agent = NodeAgent.for_store(store, master.endpoint, "gpu-1", address="tcp://gpu-1:7400",
                                    heartbeat_s=0.2).start()
        try:
            store.put(KEYS[:32], blocks_for(KEYS[:32], BB))
            agent.record_transfer(64 << 20, 0.01, tier="dram")  # 6.7 GB/s measured on the data path
            assert agent.wait_synced(10)
            with MasterClient(master.endpoint) as m:
                wait_for(lambda: len(m.nodes()) == 2 and all(n["state"] == "live" for n in m.nodes()))
                # the screen shows what the agent's heartbeats reported: wait for the one carrying its bandwidth
                wait_for(lambda: any(n["node"] == "gpu-1" and n["tiers"][0]["bw"] > 0 and n["rpc_latency_s"]
                                     for n in m.nodes()), what="gpu-1's heartbeat with its bandwidth")
                assert m.lookup(KEYS[:40]).any == 32  # 40 asked, 32 leading held: 32 hits, 8 misses
                for _ in range(3):
                    m.lookup(KEYS[:4])  # the hottest: 4 accesses each; 52 keys asked, 44 hits, 8 misses in all
                with pytest.raises(MasterError, match="bad_request"):
                    m.call(_bad_call())  # an error the master answers (and keeps in its recent errors)
            yield master, pool, store
        finally:
            agent.close()
            store.close()


def _bad_call():
    from kvtier import wire
    from kvtier.client.api import Call

    return Call(wire.LOOKUP, {"keys": b"not a multiple of sixteen"}, lambda b: b)


def test_status_screen_shows_nodes_tiers_hits_and_errors(cluster):
    master, pool, _ = cluster
    r = status("--master", master.endpoint, "--top", "5")
    assert r.returncode == 0, r.stderr
    screen = r.stdout
    assert f"kvtier-master {master.endpoint}" in screen
    assert "NODES  2 live, 0 syncing, 0 pending, 0 dead" in screen
    gpu = next(line for line in screen.splitlines() if "gpu-1" in line)
    assert "live" in gpu and "tcp://gpu-1:7400" in gpu and "dram" in gpu and "1 MiB" in gpu  # 256 x 4 KiB
    assert "GB/s" in gpu  # the measured bandwidth the agent reported
    pool_line = next(line for line in screen.splitlines() if "pool-a" in line)
    assert "8 MiB" in pool_line
    # the pool's DRAM page size, as the kernel reports it (kvtier.memory.hostmem): huge pages where THP allows them
    assert re.search(r"pages (4 KiB|2 MiB \(THP[^)]*\))$", pool_line), pool_line
    assert "pages" not in gpu  # an engine's node registers no page size
    assert "52 keys asked: 44 hits, 8 misses (84.6% hit)" in screen
    assert "lookup" in screen.split("REQUESTS", 1)[1] and "bad_request" in screen
    hottest = screen.split("HOTTEST PREFIXES", 1)[1].split("RECENT ERRORS", 1)[0]
    assert all(k.hex() in hottest for k in KEYS[:4])
    errors = screen.split("RECENT ERRORS", 1)[1]
    assert "bad_request" in errors and "(none)" not in errors
    assert screen.splitlines()[-1] == ("AGENT HINTS (kv_hints envelope)  protocol 1: Prefetch v1, Pin v1, Retain v1, "
                                       "Demote v1, Share v1")


def test_status_json_is_the_same_data(cluster):
    master, _, _ = cluster
    r = status("--master", master.endpoint, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {n["node"] for n in data["nodes"]} == {"gpu-1", "pool-a"}
    assert data["ping"]["activity"]["lookups"]["hits"] == 44
    assert data["ping"]["activity"]["lookups"]["misses"] == 8
    assert data["ping"]["activity"]["recent_errors"][0]["code"] == "bad_request"
    assert render(data) == render(json.loads(r.stdout))  # the screen is a function of the JSON


def test_status_flags_a_dead_node(cluster):
    master, pool, _ = cluster
    pool.kill()  # silent: dead after the master's 2 s lease
    with MasterClient(master.endpoint) as m:
        wait_for(lambda: any(n["state"] == "dead" for n in m.nodes()), 30)
    r = status("--master", master.endpoint)
    assert r.returncode == 0, r.stderr
    assert "1 live, 0 syncing, 0 pending, 1 dead" in r.stdout
    rows = [line for line in r.stdout.splitlines() if "pool-a" in line or "gpu-1" in line]
    assert "!!" in rows[0] and "pool-a" in rows[0] and "dead" in rows[0]  # dead nodes first, flagged


def test_status_watch_redraws(cluster):
    master, _, _ = cluster
    p = subprocess.Popen([sys.executable, "-m", "kvtier", "status", "--master", master.endpoint, "--watch",
                          "0.2"], stdout=subprocess.PIPE, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while seen.count("kvtier-master ") < 2 and time.monotonic() < deadline:
            seen += p.stdout.readline()
        assert seen.count("kvtier-master ") >= 2 and "\x1b[2J" in seen
    finally:
        p.terminate()
        p.wait(10)


def test_status_of_an_unreachable_master_is_a_clear_error(tmp_path):
    mp = MasterProcess(tmp_path)
    mp.start()
    mp.kill()  # an endpoint where nothing answers
    r = status("--master", mp.endpoint, "--timeout", "0.5")
    assert r.returncode == 1
    assert f"master {mp.endpoint} did not answer" in r.stderr and "kvtier-master running" in r.stderr


def test_activity_keeps_a_bounded_ring_of_errors_newest_first():
    from kvtier.master.activity import RECENT_ERRORS, Activity

    a = Activity()
    for i in range(3 * RECENT_ERRORS):
        a.error(float(i), "lookup", "bad_request", "x" * 5000)
        a.request("lookup", "bad_request")
    a.lookup(10, 7)
    v = a.view()
    assert len(v["recent_errors"]) == RECENT_ERRORS
    assert [e["at"] for e in v["recent_errors"][:2]] == [3 * RECENT_ERRORS - 1, 3 * RECENT_ERRORS - 2]
    assert max(len(e["message"]) for e in v["recent_errors"]) == 300
    assert v["requests"] == {"lookup": {"bad_request": 3 * RECENT_ERRORS}}
    assert v["lookups"] == {"count": 1, "keys": 10, "hits": 7, "misses": 3}


def test_status_hints_needs_no_master_and_says_what_kvtier_applies():
    """The actions and protocol versions of the standard kv_hints envelope this kvtier applies: the same answer
    the connectors apply (kvtier.connectors.kv_hints), as a line and as JSON."""
    from kvtier.connectors.kv_hints import PROTOCOL_VERSIONS, SUPPORTED

    line = status("--hints")
    assert line.returncode == 0, line.stderr
    assert line.stdout.strip() == "AGENT HINTS (kv_hints envelope)  protocol 1: " + ", ".join(
        f"{a} v{v}" for a, v in SUPPORTED.items())
    data = json.loads(status("--hints", "--json").stdout)
    assert data == {"hints": {"protocol_versions": list(PROTOCOL_VERSIONS), "actions": SUPPORTED}}
    bare = status()
    assert bare.returncode == 2 and "--master is required" in bare.stderr
