"""Standalone mode: engine processes on one host share one node pool through its shared-memory file, and keep
working (re-mapping the new file) when the pool is killed and restarted, without restarting themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from poolproc import BB, Client, PoolProcess, until


@pytest.fixture
def pool(tmp_path):
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity="8MiB") as p:
        yield p


@pytest.mark.slow  # engine processes across a pool restart
def test_processes_share_the_node_pool_and_survive_its_restart(pool, tmp_path):
    config = {"mode": "standalone", "pool": pool.ipc, "pool_timeout_ms": 500}
    a, b = Client(config, tmp_path / "a.log"), Client(config, tmp_path / "b.log")
    try:
        assert a.ask(op="put", start=0, count=50) == {"stored": 50, "skipped": 0, "rejected": 0}
        assert b.ask(op="get", start=0, count=50) == {"hits": 50, "correct": 50}  # another process's blocks
        assert b.ask(op="put", start=0, count=50)["skipped"] == 50  # held in the shared pool: no second copy
        old_file = pool.info["shm_path"]
        assert a.ask(op="maps")["maps"] == [old_file] == b.ask(op="maps")["maps"]

        pool.kill()  # kill -9: no goodbye
        assert a.ask(op="get", start=0, count=50)["hits"] == 0  # a miss within the timeout, not a hang
        pool.start()
        new_file = pool.info["shm_path"]
        assert new_file != old_file and not Path(old_file).exists()

        # The same processes, without a restart: they reconnect, map the new file and go on.
        assert until(lambda: a.ask(op="put", start=100, count=20)["stored"] == 20)
        assert until(lambda: b.ask(op="get", start=100, count=20) == {"hits": 20, "correct": 20})
        assert until(lambda: a.ask(op="maps")["maps"] == [new_file])  # the old mapping is dropped
        assert b.ask(op="get", start=0, count=50)["hits"] == 0  # the old pool's blocks died with it
    finally:
        a.close()
        b.close()
    assert "re-mapped" in (tmp_path / "a.log").read_text() or "mapped its DRAM" in (tmp_path / "a.log").read_text()


def test_a_small_private_dram_sits_above_the_node_pool(pool, tmp_path):
    config = {"mode": "standalone", "pool": pool.ipc, "standalone_dram_capacity": 4 * BB,
              "pool_offload": "write_through"}
    a, b = Client(config, tmp_path / "a.log"), Client(config, tmp_path / "b.log")
    try:
        assert a.ask(op="put", start=0, count=4)["stored"] == 4
        assert a.ask(op="put", start=4, count=4)["stored"] == 4  # evicts 0..3 from the private DRAM
        stats = a.ask(op="stats")
        assert [*stats["tiers"]] == ["dram", "pool"]
        assert stats["offloads"]["pool"]["written"] == 8  # write-through: the other processes see them
        assert b.ask(op="get", start=0, count=8) == {"hits": 8, "correct": 8}
        assert a.ask(op="get", start=0, count=4) == {"hits": 4, "correct": 4}  # back from the node pool
    finally:
        a.close()
        b.close()
