"""kvtier-master's metrics checked by Prometheus's own tooling (Debian's ``prometheus`` package): what the
daemon serves passes ``promtool check metrics`` (format and lint), and a real Prometheus server scraping the
daemon reads the values the master's own replies give (slow suite)."""

from __future__ import annotations

import pytest
from conftest import blocks_for
from masterproc import MasterProcess
from promkit import Prometheus, promtool_check, scrape

from kvtier import TieredStore
from kvtier.client import MasterClient, NodeAgent
from kvtier.keys import Namespace

BB = 4096
KEYS = Namespace("prom-test").keys(range(16))


def _busy_master(tmp_path):
    """A master with one node holding 16 keys, lookups done and one bad request answered."""
    master = MasterProcess(tmp_path, lease_s=5.0).start()
    store = TieredStore.from_config({"dram_capacity": 64 * BB}, BB)
    agent = NodeAgent.for_store(store, master.endpoint, "gpu-1", heartbeat_s=0.2).start()
    store.put(KEYS, blocks_for(KEYS, BB))
    assert agent.wait_synced(10)
    with MasterClient(master.endpoint) as m:
        m.lookup(KEYS)
        m.locate(KEYS[:2])
        m.nodes()
        with pytest.raises(Exception):
            m.top(-1)  # answered with bad_request
    return master, store, agent


def test_promtool_accepts_what_the_master_serves(tmp_path):
    master, store, agent = _busy_master(tmp_path)
    try:
        text = scrape(master.metrics_port)
        assert 'kvtier_master_requests_total{op="lookup",status="ok"}' in text
        assert 'kvtier_master_requests_total{op="locate",status="ok"}' in text  # was counted as op="unknown"
        r = promtool_check(text)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
        # The checker can fail: a metric line of a broken exposition is refused.
        bad = promtool_check(text + "kvtier_master_bogus{op=\"x\" 1\n")
        assert bad.returncode != 0
    finally:
        agent.close(), store.close(), master.kill()


@pytest.mark.slow
def test_prometheus_scrapes_the_master(tmp_path):
    master, store, agent = _busy_master(tmp_path)
    prom = Prometheus(tmp_path, {"kvtier-master": [f"127.0.0.1:{master.metrics_port}"]})
    try:
        up = prom.wait_for('up{job="kvtier-master"} == 1')
        assert len(up) == 1
        (live,) = prom.wait_for('kvtier_master_nodes{state="live"}')
        assert float(live["value"][1]) == 1
        (keys,) = prom.wait_for("kvtier_master_directory_keys > 0")
        assert float(keys["value"][1]) == len(KEYS)
        (lookups,) = prom.wait_for('kvtier_master_request_keys_total{op="lookup"}')
        assert float(lookups["value"][1]) >= len(KEYS)
        assert prom.wait_for('kvtier_master_requests_total{op="top",status="bad_request"}')
        (cap,) = prom.wait_for('kvtier_master_node_capacity_bytes{node="gpu-1",tier="dram"}')
        assert float(cap["value"][1]) == 64 * BB
    finally:
        prom.close()
        agent.close(), store.close(), master.kill()


def test_both_daemons_label_a_gate_refusal_alike():
    """One event, one reason label: the master starts every gate reason's series at zero and labels a counted
    refusal as the pool's table does (fails when either daemon names the gate's counters its own way)."""
    from prometheus_client import generate_latest

    from kvtier.auth.gate import REASONS
    from master.metrics import MasterMetrics
    from pool.metrics import REFUSED

    pool_labels = {name: reason for name, port, reason in REFUSED if port == "zmq"}
    m = MasterMetrics()
    try:
        text = generate_latest(m.registry).decode()
        for counter, reason in REASONS.items():
            assert pool_labels[counter] == reason
            assert f'kvtier_master_refused_connections_total{{port="zmq",reason="{reason}"}} 0.0' in text
        m.refused_connections("auth_no_token")
        text = generate_latest(m.registry).decode()
        assert 'kvtier_master_refused_connections_total{port="zmq",reason="no_owner_token"} 1.0' in text
    finally:
        m.close()
