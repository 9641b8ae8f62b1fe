"""kvtier-pool's Prometheus metrics (``--metrics-port``) checked by Debian's Prometheus tooling:
``promtool check metrics`` on what the pool serves, and one real Prometheus scraping both daemons (slow).

Written against the behaviour issue 15 asks for: metrics like the master's, named ``kvtier_pool_*``
(requests by op/status, bytes in/out, slots used/free/leased, evictions, clients, refused connections, staging
memory, latency histograms), the pool's ready file naming the bound ``metrics_port`` as the master's does.
"""

from __future__ import annotations

import pytest
from masterproc import MasterProcess
from poolproc import PoolProcess
from promkit import Prometheus, promtool_check, scrape

from kvtier import TieredStore
from kvtier.keys import Namespace

BB = 4096
KEYS = Namespace("pool-prom").keys(range(32))


def _pool_with_traffic(tmp_path, master: str = ""):
    pool = PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, master=master, name="pool-m",
                       args=("--metrics-port", "0", "--metrics-host", "127.0.0.1")).start()
    store = TieredStore.from_config({"mode": "distributed", "pool": pool.tcp, "dram_capacity": 64 * BB,
                                     "pool_staging_bytes": 0}, BB)
    import torch

    store.put(KEYS, torch.zeros(len(KEYS), BB, dtype=torch.uint8))
    return pool, store


def test_promtool_accepts_what_the_pool_serves(tmp_path):
    pool, store = _pool_with_traffic(tmp_path)
    try:
        text = scrape(pool.info["metrics_port"])
        for name in ("kvtier_pool_requests_total", "kvtier_pool_request_seconds", "kvtier_pool_bytes_total",
                     "kvtier_pool_slots", "kvtier_pool_evictions_total", "kvtier_pool_clients"):
            assert name in text, name
        r = promtool_check(text)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    finally:
        store.close()
        pool.kill()


@pytest.mark.slow
def test_prometheus_scrapes_master_and_pool(tmp_path):
    master = MasterProcess(tmp_path, lease_s=5.0).start()
    pool, store = _pool_with_traffic(tmp_path, master.endpoint)
    prom = Prometheus(tmp_path, {"kvtier-master": [f"127.0.0.1:{master.metrics_port}"],
                                 "kvtier-pool": [f"127.0.0.1:{pool.info['metrics_port']}"]})
    try:
        assert prom.wait_for("count(up == 1) == 2")  # both daemons scraped
        assert prom.wait_for('kvtier_master_nodes{state="live"} == 1')
        assert prom.wait_for('sum(kvtier_pool_requests_total{status="ok"}) > 0')
        assert prom.wait_for("sum(kvtier_pool_bytes_total{direction=\"in\"}) >= %d" % (len(KEYS) * BB))
    finally:
        prom.close()
        store.close()
        pool.kill()
        master.kill()
