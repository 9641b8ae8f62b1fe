"""NodeAgent: batching helpers (properties), and recovery against a real master: started before the master,
a master restarted with no state (the node must register again and resend everything), a crash loop (slow)."""

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import blocks_for
from kvtier import TieredStore
from kvtier.client import MasterClient, NodeAgent
from kvtier.client.agent import _messages, _parts
from kvtier.keys import Namespace
from masterproc import MasterProcess
from poolproc import until

BB = 4096
NS = Namespace("agent-test")
KEYS = NS.keys(range(400))


@given(sizes=st.dictionaries(st.sampled_from(["dram", "ssd", "pool"]), st.integers(0, 40), max_size=3),
       per_part=st.integers(1, 17))
@settings(max_examples=200, deadline=None)
def test_inventory_parts_cover_every_key_once(sizes, per_part):
    snapshot = {tier: [f"{tier}{i}".encode() for i in range(n)] for tier, n in sizes.items()}
    parts = list(_parts(snapshot, per_part))
    assert parts, "an inventory always has a last part, even an empty one"
    assert all(sum(len(v) for v in p.values()) <= per_part for p in parts)
    joined: dict[str, list[bytes]] = {}
    for p in parts:
        for tier, keys in p.items():
            joined.setdefault(tier, []).extend(keys)
    assert {t: k for t, k in joined.items() if k} == {t: k for t, k in snapshot.items() if k}


@given(batch=st.lists(st.tuples(st.sampled_from([0, 1]), st.sampled_from(["dram", "ssd"]), st.integers(0, 30)),
                      max_size=12), max_keys=st.integers(1, 25))
@settings(max_examples=200, deadline=None)
def test_event_messages_keep_order_and_size(batch, max_keys):
    counter = iter(range(10**6))
    events = [(kind, tier, [next(counter).to_bytes(4, "little") for _ in range(n)]) for kind, tier, n in batch]
    messages = list(_messages(events, max_keys))
    assert all(sum(len(k) for _, _, k in m) <= max_keys for m in messages)
    flat_in = [(kind, tier, k) for kind, tier, keys in events for k in keys]
    flat_out = [(kind, tier, k) for m in messages for kind, tier, keys in m for k in keys]
    assert flat_in == flat_out  # same events, same order: ADD then REMOVE of a key must not swap


def _store():
    return TieredStore.from_config({"dram_capacity": 512 * BB}, BB)


def _truth(store, keys):
    return [k for k, h in zip(keys, store.contains(keys)) if h]


def _master_view(m, node, keys):
    """Keys the master says ``node`` holds (one-key lookups, so a gap does not hide later keys)."""
    return [k for k in keys if m.lookup([k], touch=False).for_node(node)]


def test_agent_started_before_the_master_syncs_when_it_appears(tmp_path):
    mp = MasterProcess(tmp_path)
    # Reserve the endpoint by starting and stopping once, then start the agent with no master there.
    mp.start()
    mp.kill()
    s = _store()
    agent = NodeAgent.for_store(s, mp.endpoint, "early", timeout_s=0.3, heartbeat_s=0.2).start()
    try:
        s.put(KEYS[:20], blocks_for(KEYS[:20], BB))
        assert until(lambda: agent.counters["errors"] > 0, timeout=30.0)  # it tried, and found no master
        assert not agent.wait_synced(0.1)
        mp.start()
        assert agent.wait_synced(10)
        with MasterClient(mp.endpoint) as m:
            assert m.lookup(KEYS[:20]).for_node("early") == {"dram": 20}
    finally:
        agent.close(), s.close(), mp.kill()


def test_master_restarted_without_state_gets_everything_again(tmp_path):
    with MasterProcess(tmp_path, lease_s=1.0) as mp:  # no data dir: a restart forgets every node
        s = _store()
        agent = NodeAgent.for_store(s, mp.endpoint, "n1", timeout_s=0.5).start()
        try:
            s.put(KEYS[:30], blocks_for(KEYS[:30], BB))
            assert agent.wait_synced()
            mp.kill()
            mp.start()
            with MasterClient(mp.endpoint) as m:
                deadline = time.monotonic() + 5
                while m.lookup(KEYS[:30], touch=False).for_node("n1") != {"dram": 30}:
                    assert time.monotonic() < deadline, "the node never re-registered and resent its inventory"
                    time.sleep(0.05)
            # The master applies the inventory before the agent counts its reply: wait for the agent's side.
            assert agent.wait_synced()
            assert agent.counters["registrations"] >= 2 and agent.counters["inventories"] >= 2
        finally:
            agent.close(), s.close()


def test_dram_and_ssd_placements_follow_demotion(tmp_path):
    """A store with the SSD tier under a 4-block DRAM: evictions demote blocks to SSD; the master sees each
    block in the tier that holds it, and both tiers' capacities."""
    store = TieredStore.from_config({"dram_capacity": 4 * BB, "ssd_path": str(tmp_path / "ssd"),
                                     "ssd_capacity": 64 * BB, "ssd_segment_bytes": 8 * BB, "ssd_promote": False,
                                     "ssd_staging_bytes": 0}, BB)
    with MasterProcess(tmp_path) as mp:
        agent = NodeAgent.for_store(store, mp.endpoint, "tiered").start()
        try:
            for i in range(0, 12, 2):  # a put never evicts its own batch: small puts, so older ones demote
                store.put(KEYS[i : i + 2], blocks_for(KEYS[i : i + 2], BB))
            store.flush()
            assert agent.wait_synced()
            dram, ssd = _truth_in(store, "dram", KEYS[:12]), _truth_in(store, "ssd", KEYS[:12])
            assert len(dram) == 4 and len(ssd) == 8
            with MasterClient(mp.endpoint) as m:
                for k in KEYS[:12]:
                    want = {t: 1 for t, held in (("dram", dram), ("ssd", ssd)) if k in held}
                    assert m.lookup([k], touch=False).for_node("tiered") == want
                tiers = {t["name"]: t["capacity"] for t in m.nodes()[0]["tiers"]}
                assert tiers == {"dram": 4 * BB, "ssd": 64 * BB}
        finally:
            agent.close(), store.close()


def _truth_in(store, tier, keys):
    t = next(t for t in store.tiers if t.name == tier)
    return [k for k, h in zip(keys, t.contains(keys)) if h]


@pytest.mark.slow
def test_crash_loop_converges_to_the_truth(tmp_path):
    """kill -9 the master over and over while two nodes churn; once the churn stops, the master's view of each
    node equals what its store holds."""
    rng = random.Random(3)
    with MasterProcess(tmp_path, data_dir=tmp_path / "data", lease_s=1.0,
                       args=("--snapshot-interval-s", "0.5")) as mp:
        stores = {name: _store() for name in ("a", "b")}
        agents = {name: NodeAgent.for_store(s, mp.endpoint, name, timeout_s=0.5).start()
                  for name, s in stores.items()}
        stop = threading.Event()

        def churn(store, seed):
            r = random.Random(seed)
            while not stop.is_set():
                batch = r.sample(KEYS, r.randint(1, 30))
                if r.random() < 0.6:
                    store.put(batch, blocks_for(batch, BB))
                else:
                    store.remove(batch)
                time.sleep(0.005)

        threads = [threading.Thread(target=churn, args=(s, i)) for i, s in enumerate(stores.values())]
        for t in threads:
            t.start()
        try:
            for _ in range(8):
                time.sleep(rng.uniform(0.3, 1.5))
                mp.kill()
                time.sleep(rng.uniform(0.0, 0.5))
                mp.start()
            stop.set()
            for t in threads:
                t.join()
            for agent in agents.values():
                assert agent.wait_synced(15)
            with MasterClient(mp.endpoint) as m:
                for name, s in stores.items():
                    assert sorted(_master_view(m, name, KEYS)) == sorted(_truth(s, KEYS)), name
        finally:
            stop.set()
            for agent in agents.values():
                agent.close()
            for s in stores.values():
                s.close()
