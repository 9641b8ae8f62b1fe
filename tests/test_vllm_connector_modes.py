"""KVTierConnector in each mode of kv_connector_extra_config, against the real vLLM 0.33 classes and real
daemons: embedded with TP ranks on their own SSD directories (and a warm restart), standalone with a real
kvtier-pool subprocess shared by two engines through shared memory, distributed with a real kvtier-master and
kvtier-pool over loopback TCP. Every load is verified bit-exact by the engine harness after every step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.client import MasterClient  # noqa: E402
from kvtier.connectors.vllm.paths import model_dir  # noqa: E402
from kvtier.transport import connect  # noqa: E402
from masterproc import MasterProcess  # noqa: E402
from poolproc import PoolProcess, until  # noqa: E402
from vllm_engine import (  # noqa: E402
    BLOCK,
    HEAD_SIZE,
    HEADS,
    LAYERS,
    PREFIX,
    Engine,
    keys_of,
    make_request,
    save_a_then_drop_hbm,
    worker_side,
)

BLOCK_BYTES = LAYERS * BLOCK * HEADS * 2 * HEAD_SIZE * 2  # one packed block: K and V of every layer, float16


def request_b():
    return make_request("B", PREFIX + [9, 9, 9, 9])


def record_hit_sources(eng: Engine) -> list[dict]:
    """What vLLM's prefix-cache stats learn about where each external hit came from."""
    sources: list[dict] = []
    real = eng.connector.get_external_cache_hit_sources
    eng.connector.get_external_cache_hit_sources = lambda r, n: sources.append(real(r, n)) or sources[-1]
    return sources


# ---- embedded: per-rank paths -----------------------------------------------------------------------------


def test_tp_ranks_get_their_own_ssd_and_shm_paths_and_a_restart_finds_their_blocks(engine, model, tmp_path):
    ssd, shm = tmp_path / "ssd", tmp_path / "shm"
    opts = {"tp": 2, "ssd_path": str(ssd), "ssd_capacity": "16MiB", "ssd_segment_bytes": "1MiB",
            "ssd_offload": "write_through", "dram_shm_path": str(shm)}
    first = engine(**opts)  # both ranks open an SSD tier and map a DRAM file: no DirectoryInUse
    save_a_then_drop_hbm(first)
    b = request_b()
    for rank in (0, 1):
        store = worker_side(first, rank).store
        assert store.flush(10)
        assert store.tiers[1].path == ssd / model_dir(model) / f"tp{rank}of2"
        assert store.tiers[1].contains(keys_of(first, b, rank)[:5]) == [True] * 5  # each rank its own slice
        assert (shm / model_dir(model) / f"tp{rank}of2").is_file()
    first.close()

    second = engine(**opts)  # a restarted server: empty DRAM, the same directories
    for rank in (0, 1):
        store = worker_side(second, rank).store
        assert list(store.tiers[0].contains(keys_of(second, b, rank)[:5])) == [False] * 5
    sources = record_hit_sources(second)
    second.add(b)
    second.run([b])  # each rank's blocks verified bit-exact (a rank's KV differs from the other's)
    assert second.load_errors == set()
    assert sources == [{CacheHitSource.DISK: 5 * BLOCK}]
    for rank in (0, 1):
        assert worker_side(second, rank).store.stats()["tiers"]["ssd"]["hits"] == 5


# ---- standalone: one kvtier-pool for the engines of a host --------------------------------------------------


@pytest.fixture
def node_pool(tmp_path):
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity="8MiB") as pool:
        yield pool


def standalone(pool: PoolProcess) -> dict:
    return {"mode": "standalone", "pool": pool.ipc, "pool_timeout_ms": 2000}


def test_standalone_engines_share_the_node_pool(engine, node_pool):
    a_engine = engine(tp=2, **standalone(node_pool))
    save_a_then_drop_hbm(a_engine)
    b = request_b()
    k0, k1 = keys_of(a_engine, b, 0)[:5], keys_of(a_engine, b, 1)[:5]
    assert not set(k0) & set(k1)  # the ranks' slices under their own keys, in one pool
    block_bytes = worker_side(a_engine).store.block_bytes
    probe = connect(node_pool.ipc, block_bytes, timeout_s=2.0)  # the pool, seen from outside the engines
    try:
        assert probe.contains(k0 + k1) == [True] * 10
    finally:
        probe.close()
    assert [t.name for t in worker_side(a_engine).store.tiers] == ["pool"]  # no private DRAM

    b_engine = engine(tp=2, **standalone(node_pool))  # another server on this host
    sources = record_hit_sources(b_engine)
    b_engine.add(b)
    b_engine.run([b])  # bit-exact per rank: a rank reading the other's slice would fail here
    assert b_engine.load_errors == set()
    assert sources == [{CacheHitSource.HOST: 5 * BLOCK}]  # the node pool is this host's DRAM
    for rank in (0, 1):
        stats = worker_side(b_engine, rank).store.stats()
        assert stats["get_hits"] == 5 and stats["put_stored"] == 0  # loaded, and nothing stored twice


def test_standalone_block_evicted_from_the_pool_after_lookup_is_recomputed(engine, node_pool):
    """A remote pool does not honour the lookup's pins: a block gone before the load is a load error that
    vLLM recomputes, never wrong bytes, and the recomputed block is stored again."""
    eng = engine(**standalone(node_pool))
    save_a_then_drop_hbm(eng)
    side = worker_side(eng)
    b = request_b()
    keys = keys_of(eng, b)[:5]
    eng.add(b)
    eng.step()  # sends the lookup
    assert until(lambda: side._server.served >= 1, timeout=10, interval=0.005)
    other = connect(node_pool.ipc, side.store.block_bytes, timeout_s=2.0)  # another client of the pool
    try:
        assert other.remove([keys[2]]) == 1
        eng.run([b])
        assert len(eng.load_errors) == 1  # B's third block: reported, recomputed, verified after every step
        assert other.contains(keys) == [True] * 5  # the recomputed block went back to the pool
    finally:
        other.close()
    assert side.store.stats()["get_misses"] == 1


# ---- distributed: kvtier-master + kvtier-pool, engines on two nodes -----------------------------------------


def test_distributed_node2_loads_the_prefix_node1_saved_from_the_pool(engine, tmp_path):
    with MasterProcess(tmp_path, lease_s=5.0) as master, \
            PoolProcess(tmp_path, master=master.endpoint, capacity="8MiB", block_bytes=BLOCK_BYTES,
                        args=("--heartbeat-s", "0.2")):
        with MasterClient(master.endpoint) as m:
            assert until(lambda: any(n["state"] == "live" for n in m.nodes()))  # the pool can be placed on
        cfg = {"mode": "distributed", "master": master.endpoint, "pool_timeout_ms": 2000,
               "pool_staging_bytes": "1MiB", "pool_promote": True}
        node1 = engine(node_id="node-1", **cfg)
        save_a_then_drop_hbm(node1)
        assert worker_side(node1).store.flush(10)  # write-through to the pool, behind the saves

        node2 = engine(node_id="node-2", **cfg)  # its own DRAM, empty
        b = request_b()
        store2 = worker_side(node2).store
        assert store2.block_bytes == BLOCK_BYTES
        keys = keys_of(node2, b)[:5]
        assert keys == keys_of(node1, b)[:5]  # one namespace on every node
        assert [t.name for t in store2.tiers] == ["dram", "pool"]
        # The master learns what the pool holds from the pool's own events.
        assert until(lambda: store2.contains(keys) == [True] * 5)
        assert list(store2.tiers[0].contains(keys)) == [False] * 5
        sources = record_hit_sources(node2)
        node2.add(b)
        node2.run([b])
        assert node2.load_errors == set()
        assert sources == [{CacheHitSource.P2P: 5 * BLOCK}]  # another node's DRAM
        assert store2.stats()["tiers"]["pool"]["hits"] == 5
        assert list(store2.tiers[0].contains(keys)) == [True] * 5  # promoted into node 2's DRAM
        node1.close()
        node2.close()  # before the daemons go


# ---- the documentation's commands (README.md and docs/*.md) ---------------------------------------------------


def readme_commands(program: str) -> list[list[str]]:
    """Every ``program ...`` command of the bash blocks of README.md and the docs pages (docs/vllm.md, pool.md,
    master.md, ...), each once, split as a shell would (lines joined)."""
    from doctext import commands

    # A vllm serve command spans a paragraph; the daemons' commands are one line each.
    return commands("vllm serve " if program == "vllm" else program + " ", paragraphs=program == "vllm")


def test_readme_vllm_commands_parse_with_vllms_and_kvtiers_own_parsers():
    import json

    from vllm.config import KVTransferConfig

    from kvtier.connectors.vllm.settings import split_extra_config

    commands = readme_commands("vllm")
    modes = set()
    for words in commands:
        transfer = KVTransferConfig(**json.loads(words[words.index("--kv-transfer-config") + 1]))
        assert transfer.kv_connector == "KVTierConnector"
        assert transfer.kv_connector_module_path == "kvtier.connectors.vllm"
        _, config = split_extra_config(transfer.kv_connector_extra_config)  # unknown keys raise
        modes.add(config.mode)
    assert modes == {"embedded", "standalone", "distributed"}


@pytest.mark.parametrize("program", ["kvtier-pool", "kvtier-master"])
def test_readme_daemon_commands_parse_with_their_own_parsers(program):
    from kvtier.master.cli import build_parser as master_parser
    from kvtier.pool.cli import build_parser as pool_parser

    parser = {"kvtier-pool": pool_parser, "kvtier-master": master_parser}[program]()
    commands = readme_commands(program)
    assert commands
    for words in commands:
        parser.parse_args(words[1:])  # SystemExit on an unknown or malformed option
