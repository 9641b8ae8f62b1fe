"""Real vLLM engines sharing blocks through real kvtier daemons (subprocesses, as README.md and docs/ start them).

* Standalone: two engine processes of one host share one kvtier-pool (ipc + shared memory); the second
  loads what the first saved.
* Distributed: a kvtier-master and a remote kvtier-pool (tcp); the engine of "node 2" loads what "node 1"
  saved, found through the master's directory.
* Fault: the pool is killed (-9) mid-run: the master still lists its blocks (its lease has not run out), so
  node 2's lookup finds them and the load fails; vLLM recomputes (kv_load_failure_policy: recompute) and the
  outputs still equal the reference.
"""

from __future__ import annotations

import time

import pytest
from .enginekit import BLOCK, Engines, Reference, assert_same, connector, prompt_tokens
from masterproc import MasterProcess
from poolproc import PoolProcess

from kvtier.client import MasterClient

pytestmark = pytest.mark.slow

P3, P4, P5 = prompt_tokens(3), prompt_tokens(4), prompt_tokens(5)
FULL = (len(P3) // BLOCK) * BLOCK
BLOCKS = FULL // BLOCK
TINY_LLAMA_BLOCK_BYTES = 2 * BLOCK * 2 * 2 * 64 * 2  # layers x tokens x KV heads x (K, V) x head_dim x bf16


def until(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.2)
    return value


def test_standalone_two_engines_share_one_pool(engines: Engines, model, reference: Reference, work):
    tmp = work / "standalone"
    tmp.mkdir()
    with PoolProcess(tmp, tcp=False, ipc=True, capacity="64MiB") as pool:
        config = connector({"mode": "standalone", "pool": pool.ipc, "ipc_dir": str(tmp)})
        first = engines.start("standalone-1", model, config)
        second = engines.start("standalone-2", model, config)
        a = first.generate([P3 + [5]])[0]
        assert a["cached"] == 0
        assert_same(a, reference(P3 + [5]))
        before = second.metrics()
        b = second.generate([P3 + [6, 7]])[0]
        after = second.metrics()
        assert b["cached"] == FULL  # the second process loaded the first one's blocks from the node pool
        name = "vllm:prompt_tokens_cached_by_source{source=host}"  # the node pool is this host's DRAM
        assert after.get(name, 0) - before.get(name, 0) == FULL
        assert_same(b, reference(P3 + [6, 7]))
        (store,) = second.store_stats()
        assert store["tiers"]["pool"]["hits"] >= BLOCKS
        for e in (first, second):
            assert e.close() == 0


class Cluster:
    master: MasterProcess
    pool: PoolProcess


@pytest.fixture(scope="module")
def cluster(work):
    tmp = work / "distributed"
    tmp.mkdir()
    c = Cluster()
    # The master's lease outlives the test: a pool killed -9 stays listed (as a dead host would, for a lease).
    # A pool under a master needs --block-bytes: it registers (and so can be placed on) only once it knows its
    # block size, which without the flag only a first client's hello would tell it.
    with MasterProcess(tmp, lease_s=120.0) as c.master, \
            PoolProcess(tmp, tcp=True, capacity="64MiB", master=c.master.endpoint, name="pool-a",
                        block_bytes=TINY_LLAMA_BLOCK_BYTES) as c.pool:
        yield c


def test_distributed_node2_loads_what_node1_saved(engines: Engines, model, reference: Reference, work, cluster):
    # pool_timeout_ms: this test is about what node 2 finds, not about deadlines (tests/test_pool_master_down.py and
    # tests/test_pool_netns.py test those).
    # With the default 0.5 s, a busy 2-core CI machine (four engines, a master and a pool) timed out node 2's
    # first connection to the pool or a call to the master: the pool went into its back-off, node 2's lookup
    # found nothing (cached 0), and the fault test below then saw no load go to the dead pool.
    base = {"mode": "distributed", "master": cluster.master.endpoint, "dram_capacity": "64MiB",
            "ipc_dir": str(work / "distributed"), "pool_timeout_ms": 4000}
    node1 = engines.start("node-1", model, connector({**base, "node_id": "node-1"}))
    node2 = engines.start("node-2", model, connector({**base, "node_id": "node-2"}))
    with MasterClient(cluster.master.endpoint) as m:
        node1.generate([P4 + [1]])
        node1.generate([P5 + [1]])  # for the fault test: node 2 never reads it before the pool dies
        until(lambda: m.ping()["keys"] >= 2 * BLOCKS, 60, "the master hears of node 1's blocks in the pool")
    before = node2.metrics()
    b = node2.generate([P4 + [2, 3]])[0]
    after = node2.metrics()
    assert b["cached"] == FULL
    name = "vllm:prompt_tokens_cached_by_source{source=p2p}"  # another node's DRAM
    assert after.get(name, 0) - before.get(name, 0) == FULL
    assert_same(b, reference(P4 + [2, 3]))
    (store,) = node2.store_stats()
    assert store["tiers"]["pool"]["hits"] >= BLOCKS


def test_pool_killed_mid_run_loads_fail_and_vllm_recomputes(engines: Engines, reference: Reference, cluster):
    (node2,) = [e for e in engines.started if e.log_path.name == "node-2.log"]
    endpoint = cluster.pool.tcp
    cluster.pool.kill()  # no goodbye: the master keeps listing its blocks until its lease runs out
    c = node2.generate([P5 + [2, 3]])[0]
    assert_same(c, reference(P5 + [2, 3]))
    (store,) = node2.store_stats()
    pool = store["tiers"]["pool"]
    assert pool["extra"]["pools"][endpoint]["last_error"], pool  # the load went to the dead pool and failed
    assert pool["misses"] >= BLOCKS
    # The engine goes on: the next request is a plain miss (the pool is in back-off) and still correct.
    d = node2.generate([P5 + [4]])[0]
    assert_same(d, reference(P5 + [4]))
