"""kvtier-master as a real subprocess, real zmq, real lmdb; nodes are real TieredStores with NodeAgents."""

import asyncio
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from conftest import blocks_for
from kvtier import TieredStore
from kvtier.client import (AsyncMasterClient, MasterClient, MasterError, MasterTimeout, MasterUnknownNode,
                           NodeAgent, Router)
from kvtier.client import api
from kvtier.keys.hashers import VllmBlockHasher
from kvtier.keys import Namespace
from masterproc import MasterProcess
from poolproc import until, wait_for

BB = 4096
NS = Namespace("daemon-test")


def store(blocks=64):
    return TieredStore.from_config({"dram_capacity": blocks * BB}, BB)


def held(m: MasterClient, keys, node="w1", tier="dram"):
    return m.lookup(keys, touch=False).for_node(node).get(tier, 0)


def node_holding(master, keys, name="w1", **agent_args):
    """A store holding ``keys`` and its started agent, synced with the master."""
    s = store()
    agent = NodeAgent.for_store(s, master.endpoint, name, **agent_args).start()
    s.put(keys, blocks_for(keys, BB))
    assert agent.wait_synced()
    return s, agent


@pytest.fixture
def master(tmp_path):
    with MasterProcess(tmp_path, data_dir=tmp_path / "data", lease_s=1.0) as mp:
        yield mp


def test_store_events_reach_the_directory_and_the_router_ranks_holders_first(master):
    keys = NS.keys(range(40))
    s1, s2 = store(64), store(16)
    a1 = NodeAgent.for_store(s1, master.endpoint, "w1").start()
    a2 = NodeAgent.for_store(s2, master.endpoint, "w2").start()
    try:
        s1.put(keys[:30], blocks_for(keys[:30], BB))
        s2.put(keys[:10], blocks_for(keys[:10], BB))
        assert a1.wait_synced() and a2.wait_synced()
        with MasterClient(master.endpoint) as m:
            res = m.lookup(keys)
            assert res.any == 30 and res.for_node("w1") == {"dram": 30} and res.for_node("w2") == {"dram": 10}
            # Evictions in w2's 16-block tier are REMOVE events.
            s2.put(keys[10:26], blocks_for(keys[10:26], BB))
            assert a2.wait_synced()
            truth = s2.lookup_prefix(keys).length
            assert wait_for(lambda: held(m, keys, "w2") == truth, what="w2 evictions to show") and truth < 16
            s1.remove(keys[5:6])
            assert wait_for(lambda: held(m, keys, "w1") == 5, what="w1 removal to show")
            router = Router(m, NS, block_tokens=16, prefill_tokens_per_s=1000.0)
            plans = router.rank(keys, ["w3", "w2", "w1"])
            # w2's LRU evicted the oldest blocks (the prefix): only w1 holds the 5 leading blocks locally.
            assert plans[0].worker == "w1" and plans[0].local_tokens == {"dram": 5 * 16}
            assert all(p.local_tokens == {} and p.remote_tokens == 5 * 16 for p in plans[1:])
            assert plans[0].total_s < plans[1].total_s
            # Used bytes come with the next heartbeat (every lease / 3).
            w1 = wait_for(lambda: next((n for n in m.nodes() if n["node"] == "w1" and
                                        n["tiers"][0]["used"] == 29 * BB), None), what="used bytes")
            assert w1["state"] == "live" and w1["tiers"][0]["capacity"] == 64 * BB
    finally:
        a1.close(), a2.close(), s1.close(), s2.close()


def test_router_prices_a_hybrid_prompt_at_its_held_restore_point(master):
    """A hybrid model's prompt through the SDK and a real master: w1 holds 12 full-attention blocks but the
    recurrent state only at block 6 (the state at 12 is nowhere), so the plan restores 6 blocks plus that
    state, and the rest is recomputed; priced as a uniform prompt it would load all 12."""
    keys = NS.keys(range(12))
    states = Namespace("daemon-test/state").keys(range(12))  # the state after block i, as a connector keys it
    s, agent = node_holding(master, keys + [states[5]])
    try:
        with MasterClient(master.endpoint) as m:
            router = Router(m, NS, block_tokens=16, prefill_tokens_per_s=10.0)
            best = router.rank(keys, ["w2", "w1"], checkpoints=[(6, [states[5]]), (12, [states[11]])])[0]
            assert best.worker == "w1" and best.load_tokens == 6 * 16 and best.load_bytes == 7 * BB
            assert best.recompute_tokens == 6 * 16
            uniform = router.rank(keys, ["w2", "w1"])[0]
            assert uniform.load_tokens == 12 * 16 and uniform.load_bytes == 12 * BB
            nothing = router.rank(keys, ["w1"], checkpoints=[(12, [states[11]])])[0]
            assert nothing.load_tokens == 0 and nothing.recompute_tokens == 12 * 16
    finally:
        agent.close(), s.close()


def test_router_token_ids_with_the_vllm_hasher_find_what_the_engine_stored(master):
    hasher = VllmBlockHasher(16)
    tokens = list(range(1000, 1000 + 16 * 12 + 5))  # 12 full blocks and a partial one
    engine_keys = NS.keys(hasher.hashes(tokens))  # what a vLLM connector stores under
    s = store()
    agent = NodeAgent.for_store(s, master.endpoint, "w1").start()
    try:
        s.put(engine_keys[:8], blocks_for(engine_keys[:8], BB))
        assert agent.wait_synced()
        with MasterClient(master.endpoint) as m:
            router = Router(m, NS, hasher=hasher, prefill_tokens_per_s=1000.0)
            assert router.keys_for(tokens) == engine_keys
            best = router.rank(tokens, ["w2", "w1"])[0]
            assert best.worker == "w1" and best.local_tokens == {"dram": 8 * 16}
            assert best.load_tokens + best.recompute_tokens == len(tokens)
    finally:
        agent.close(), s.close()


def test_dead_node_placements_vanish_when_its_lease_ends(master):
    keys = NS.keys(range(100, 120))
    s, agent = node_holding(master, keys)
    with MasterClient(master.endpoint) as m:
        assert held(m, keys) == 20
        agent.close()  # heartbeats stop; the process holding the blocks is "gone"
        t0 = time.monotonic()
        wait_for(lambda: held(m, keys) == 0, timeout=5.0, what="placements to vanish")
        # The lease plus the master's sweep, with slack for a loaded CI machine.
        assert time.monotonic() - t0 <= 1.0 + 1.5, "placements outlived the 1 s lease"
        assert {n["node"]: n["state"] for n in m.nodes()}["w1"] == "dead"
        # A heartbeat from the dead node is refused: it must register again (and then resync).
        with pytest.raises(MasterUnknownNode):
            m.call(api.heartbeat("w1", agent.incarnation, agent.seq, {}, {}, {}, 0.0))
    s.close()


def test_kill9_restart_answers_correctly_within_one_lease(tmp_path):
    keys = NS.keys(range(200, 260))
    # Snapshots every 0.2 s: the restarted master holds a snapshot that is stale by the time it starts.
    with MasterProcess(tmp_path, data_dir=tmp_path / "data", lease_s=1.0,
                       args=("--snapshot-interval-s", "0.2")) as master:
        s, agent = node_holding(master, keys[:40])
        try:
            assert until(lambda: "directory snapshot: 40 keys" in master.log(), timeout=30.0), master.log()[-2000:]
            master.kill()
            s.put(keys[40:50], blocks_for(keys[40:50], BB))  # events while the master is down
            s.remove(keys[:2])
            master.start()
            t0 = time.monotonic()
            with MasterClient(master.endpoint, timeout_s=1.0) as m:
                seen = []

                def correct():
                    seen.append(held(m, keys[2:]))
                    return seen[-1] == 48 and held(m, keys) == 0

                wait_for(correct, timeout=5.0, what="lookups to be correct after the restart")
                elapsed = time.monotonic() - t0
                # Within a lease, plus the agent's retry backoff (up to 0.5 s) and slack for a loaded machine.
                assert elapsed <= master.lease_s + 1.25, f"resync took {elapsed:.2f} s, lease {master.lease_s} s"
                # Never a wrong answer meanwhile: nothing (not confirmed yet) or the truth, never the stale
                # snapshot's 38 blocks.
                assert set(seen) <= {0, 48}, seen
        finally:
            agent.close(), s.close()


def test_sigterm_flushes_directory_heat_nodes_and_hints(tmp_path):
    # A lease long enough that w1 is still live when the master snapshots it, however slow this machine is
    # (with the fixture's 1 s it could die between the agent's close and the SIGTERM, and a dead node
    # restores as dead, not pending).
    with MasterProcess(tmp_path, data_dir=tmp_path / "data", lease_s=10.0) as master:
        _sigterm_flushes(master)


def _sigterm_flushes(master):
    keys = NS.keys(range(300, 310))
    s, agent = node_holding(master, keys)
    with MasterClient(master.endpoint) as m:
        for _ in range(3):
            m.lookup(keys[:4])
        m.pin(keys[:2], ttl_s=600)
        m.pin(session="agent-42")
    agent.close()
    assert master.terminate() == 0
    assert "state flushed to disk" in master.log() and "Traceback" not in master.log()
    master.start()
    with MasterClient(master.endpoint) as m:
        assert m.heat(keys[:5]).count == [3, 3, 3, 3, 0]
        nodes = {n["node"]: n for n in m.nodes()}
        assert nodes["w1"]["state"] == "pending" and nodes["w1"]["applied_seq"] == agent.seq
        h = m.hints()
        assert set(h.key_pins) == set(keys[:2]) and "agent-42" in h.session_pins
        assert m.lookup(keys, touch=False).any == 0  # a pending node is not answered from
    s.close()


def test_event_gap_makes_the_master_ask_for_an_inventory(master):
    keys = NS.keys(range(400, 410))
    with MasterClient(master.endpoint) as m:
        reg = m.call(api.register("raw", "inc-1", 0, [("dram", 1 << 20)]))
        assert reg.resync
        m.call(api.inventory("raw", "inc-1", 0, 0, True, {"dram": keys[:5]}, {"dram": BB}))
        assert m.call(api.events("raw", "inc-1", 1, [(0, "dram", keys[5:6], BB)])).applied_seq == 1
        gap = m.call(api.events("raw", "inc-1", 3, [(0, "dram", keys[6:7], BB)]))
        assert gap.resync and m.lookup(keys).any == 0
        m.call(api.inventory("raw", "inc-1", 3, 0, True, {"dram": keys[:7]}, {"dram": BB}))
        assert m.lookup(keys).for_node("raw") == {"dram": 7}


def test_master_pins_become_store_pins(master):
    keys = NS.keys(range(500, 510))
    s, agent = node_holding(master, keys, heartbeat_s=0.1)
    try:
        with MasterClient(master.endpoint) as m:
            m.pin(keys[:3], ttl_s=60)
            wait_for(lambda: all(s.pins.count(k) == 1 for k in keys[:3]), what="pins to reach the store")
            assert s.pins.count(keys[3]) == 0
            m.unpin(keys[:3])
            wait_for(lambda: all(s.pins.count(k) == 0 for k in keys[:3]), what="unpins to reach the store")
    finally:
        agent.close(), s.close()


def test_metrics_endpoint_counts_requests_and_nodes(master):
    keys = NS.keys(range(600, 605))
    with MasterClient(master.endpoint) as m:
        m.call(api.register("mx", "i", 0, [("dram", 1000), ("ssd", 4000)]))
        m.call(api.inventory("mx", "i", 0, 0, True, {"dram": keys}, {"dram": BB}))
        m.call(api.heartbeat("mx", "i", 0, {"dram": 250}, {"dram": 5e9}, {}, 0.001))
        for _ in range(7):
            m.lookup(keys)
        with pytest.raises(MasterError, match="unknown_op"):
            m.call(api.Call("no_such_op", {}, dict))
    text = urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5).read().decode()

    def value(pattern):
        match = re.search(r"^" + re.escape(pattern) + r" (\S+)$", text, re.M)
        assert match, f"metric {pattern} missing"
        return float(match.group(1))

    assert value('kvtier_master_requests_total{op="lookup",status="ok"}') == 7
    assert value('kvtier_master_request_keys_total{op="lookup"}') == 35
    assert value('kvtier_master_requests_total{op="unknown",status="unknown_op"}') == 1
    assert value('kvtier_master_request_seconds_count{op="lookup"}') == 7
    assert value('kvtier_master_node_utilization{node="mx",tier="dram"}') == 0.25
    assert value('kvtier_master_node_bandwidth_bytes_per_second{node="mx",tier="dram"}') == 5e9
    assert value('kvtier_master_node_capacity_bytes{node="mx",tier="ssd"}') == 4000


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_client_times_out_then_reconnects_when_the_master_appears(tmp_path):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with MasterClient(endpoint, timeout_s=0.3) as m:
        t0 = time.monotonic()
        with pytest.raises(MasterTimeout, match="ping"):
            m.ping()
        assert time.monotonic() - t0 < 1.0
        mp = MasterProcess(tmp_path)
        mp.bind = endpoint
        with mp:
            m.timeout_s = 5.0
            assert m.ping()["version"] == 1


def test_async_client_many_calls_in_flight(master):
    keys = NS.keys(range(700, 764))

    async def main():
        async with AsyncMasterClient(master.endpoint) as m:
            await m.call(api.register("as", "i", 0, [("dram", 1 << 30)]))
            await m.call(api.inventory("as", "i", 0, 0, True, {"dram": keys[:32]}, {"dram": BB}))
            results = await asyncio.gather(*(m.lookup(keys[: 1 + i]) for i in range(64)))
            assert [r.for_node("as").get("dram", 0) for r in results] == [min(i + 1, 32) for i in range(64)]
            plans = await Router(m, NS, block_tokens=16).rank_async(keys, ["x", "as"])
            assert plans[0].worker == "as"
            with pytest.raises(MasterTimeout):
                await m.call(api.ping(), timeout_s=0.0)

    asyncio.run(main())


def test_cli_start_errors_are_one_line(master, tmp_path):
    in_use = subprocess.run([sys.executable, "-m", "kvtier.master", "--bind", master.endpoint,
                             "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
    assert in_use.returncode == 2 and in_use.stderr.strip().startswith("kvtier-master: error:")
    assert "Traceback" not in in_use.stderr and len(in_use.stderr.strip().splitlines()) == 1
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    bad_dir = subprocess.run([sys.executable, "-m", "kvtier.master", "--bind", "tcp://127.0.0.1:*",
                              "--metrics-port", "-1", "--data-dir", str(blocked / "x")],
                             capture_output=True, text=True, timeout=60)
    assert bad_dir.returncode == 2 and "cannot open the master's lmdb" in bad_dir.stderr
    assert "Traceback" not in bad_dir.stderr


def test_large_inventory_in_parts(master):
    keys = np.random.default_rng(1).integers(0, 2**63, size=(50_000, 2), dtype=np.uint64)
    blob = keys.tobytes()
    key_list = [blob[i : i + 16] for i in range(0, len(blob), 16)]
    agent = NodeAgent(master.endpoint, "big", [("ssd", 1 << 40)], block_bytes=BB, inventory_part_keys=8192,
                      initial={"ssd": key_list}).start()
    try:
        assert agent.wait_synced(30)
        with MasterClient(master.endpoint) as m:
            assert m.lookup(keys, touch=False).for_node("big") == {"ssd": 50_000}
            assert m.ping()["keys"] >= 50_000
    finally:
        agent.close()
