"""The shared directory's history lost or rolled back under running masters (real redis-server, real
kvtier-master subprocesses, a real NodeAgent): Redis restarted behind its last writes, an older copy of its
data restored, Redis restarted empty, FLUSHALL, one master seeing it later than the other. Whatever the loss,
every master ends with a new epoch, and every node, told at its next contact, resyncs with a full inventory:
the masters list exactly what the node holds. A restart that lost nothing starts no new epoch (the negative
control)."""

from __future__ import annotations

import contextlib
import shutil
import time

import pytest

from conftest import blocks_for
from kvtier.client import MasterClient, api
from poolproc import wait_for
from redisproc import RedisProcess, needs_redis
from test_master_redis import BB, masters, metric, node_store

pytestmark = needs_redis


@pytest.fixture
def redis(tmp_path):
    with RedisProcess(tmp_path) as r:
        yield r


def copy_data(redis: RedisProcess, to) -> None:
    """A copy of Redis's data as it is now (stopped for the copy: its append-only file is fsynced per write)."""
    redis.kill()
    shutil.copytree(redis.dir, to)
    redis.start()


def restart(redis: RedisProcess, data=None, empty: bool = False) -> None:
    """kill -9; back 0.3 s later with its own data, with the copy ``data``, or with nothing."""
    redis.kill()
    time.sleep(0.3)
    if data is not None or empty:
        shutil.rmtree(redis.dir)
        if data is not None:
            shutil.copytree(data, redis.dir)
        else:
            redis.dir.mkdir()
    redis.start()


def listed(clients, keys, node: str = "w1") -> list[int]:
    """Per master, how many of ``keys`` it lists on the node (one lookup per key: a lookup counts leading keys)."""
    return [sum(c.lookup([k], touch=False).for_node(node).get("dram", 0) for k in keys) for c in clients]


def exactly(clients, held, gone) -> bool:
    """Every master lists every block the node holds, and none it removed."""
    return listed(clients, held) == [len(held)] * len(clients) and listed(clients, gone) == [0] * len(clients)


def epochs(clients) -> set[str]:
    return {c.ping()["backend"]["epoch"] for c in clients}


def losses(ms) -> float:
    return sum(metric(m, "kvtier_master_directory_losses_total") for m in ms)


@contextlib.contextmanager
def cluster(tmp_path, redis, make_keys, args=()):
    """Two masters, a node holding 30 blocks (synced through both), and a client per master."""
    with masters(tmp_path, redis, 2, lease_s=3.0, args=args) as ms, contextlib.ExitStack() as closing:
        keys = make_keys(30)
        s, agent = node_store(",".join(m.endpoint for m in ms), "w1", keys, heartbeat_s=0.2)
        closing.callback(s.close)
        closing.callback(agent.close)
        clients = [closing.enter_context(MasterClient(m.endpoint, timeout_s=3.0)) for m in ms]
        wait_for(lambda: exactly(clients, keys, []), 10.0, "both masters listing the 30 blocks")
        yield ms, s, agent, clients, keys


def test_the_issue_sequence_a_short_restart_that_lost_nothing(tmp_path, redis, make_keys):
    """The issue's sequence: 30 blocks, 5 removed, Redis killed and back with its data 0.3 s later, 10 more
    removed: both masters list the 15 left. Nothing was lost, so no new epoch (no needless resync storm)."""
    with cluster(tmp_path, redis, make_keys) as (ms, s, agent, clients, keys):
        s.remove(keys[:5])
        assert agent.wait_synced(10.0)
        before = epochs(clients)
        restart(redis)
        s.remove(keys[5:15])
        assert agent.wait_synced(20.0)
        wait_for(lambda: exactly(clients, keys[15:], keys[:15]), 10.0, "both masters listing the 15 left")
        assert epochs(clients) == before and losses(ms) == 0


@pytest.mark.parametrize("loss,snapshots", [("older_copy", False), ("older_copy", True), ("last_writes_lost", False),
                                            ("empty", False), ("flushall", False)])
def test_every_loss_of_the_directory_reaches_the_node_as_a_full_resync(tmp_path, redis, make_keys, loss, snapshots):
    """The node's events went in (both masters listed them) and then Redis lost them: restored to a copy from
    before them, or with its last writes lost (what a kill -9 with appendfsync everysec or an OS crash loses),
    restarted empty, or flushed under the running masters. The node is told at its next contact, sends a full
    inventory, and both masters list exactly what it holds, under one new epoch. ``snapshots``: the masters
    snapshot (and trim the log) every 0.3 s throughout, across the rollback."""
    args = ("--snapshot-interval-s", "0.3") if snapshots else ()
    with cluster(tmp_path, redis, make_keys, args) as (ms, s, agent, clients, keys):
        if loss == "older_copy":
            copy_data(redis, tmp_path / "copy")
        s.remove(keys[:5])
        assert agent.wait_synced(10.0)
        wait_for(lambda: exactly(clients, keys[5:], keys[:5]), 10.0, "the removal applied")
        if loss == "last_writes_lost":
            copy_data(redis, tmp_path / "copy")
            s.remove(keys[5:10])
            assert agent.wait_synced(10.0)
            wait_for(lambda: exactly(clients, keys[10:], keys[:10]), 10.0, "the last writes applied")
        wait_for(lambda: not agent.need_inventory, 5.0)
        inventories, before = agent.counters["inventories"], epochs(clients)
        if loss == "flushall":
            import redis as redis_py

            with redis_py.Redis.from_url(redis.url) as r:
                r.flushall()
        else:
            restart(redis, data=tmp_path / "copy" if loss in ("older_copy", "last_writes_lost") else None,
                    empty=loss == "empty")
        s.remove(keys[10 if loss == "last_writes_lost" else 5 : 15])  # the node holds keys[15:] from here on
        wait_for(lambda: agent.counters["inventories"] > inventories, 15.0, "the node's full resync")
        assert agent.wait_synced(20.0)
        wait_for(lambda: exactly(clients, keys[15:], keys[:15]), 10.0, "both masters listing the 15 left")
        after = epochs(clients)
        assert len(after) == 1 and after != before
        assert losses(ms) >= 1
        assert "lost writes this master applied" in ms[0].log() + ms[1].log()


def test_a_rollback_to_a_node_mid_inventory_is_not_a_node_left_waiting(tmp_path, redis, make_keys):
    """The copy restored was taken while the node's inventory was under way (its first part in, not its last).
    Rolled back there, the masters would wait for the rest of that inventory forever while the node, which
    finished it long ago, believes it is in sync: heartbeats and events both answered 'no resync', the node's
    blocks listed nowhere. The rollback must reach the node as a resync instead."""
    with masters(tmp_path, redis, 2, lease_s=3.0, args=("--max-batch-keys", "8")) as ms, \
            contextlib.ExitStack() as closing:
        from kvtier import TieredStore
        from kvtier.client import NodeAgent

        keys = make_keys(30)
        s = TieredStore.from_config({"dram_capacity": 4096 * BB}, BB)
        closing.callback(s.close)
        agent = NodeAgent.for_store(s, ",".join(m.endpoint for m in ms), "w1", timeout_s=0.5, heartbeat_s=0.2)
        closing.callback(agent.close)
        tiers = agent.tiers
        with MasterClient(ms[0].endpoint) as m:  # the node's first registration, and its inventory's first part
            m.call(api.register("w1", agent.incarnation, 0, tiers))
            m.call(api.inventory("w1", agent.incarnation, 0, 0, False, {"dram": keys[:8]}, {"dram": BB}))
        copy_data(redis, tmp_path / "copy")
        clients = [closing.enter_context(MasterClient(m.endpoint, timeout_s=3.0)) for m in ms]
        wait_for(lambda: all(c.ping()["backend"]["state"] == "ok" for c in clients), 20.0)
        s.put(keys, blocks_for(keys, BB))
        agent.start()  # registers again, sends its whole inventory, then events
        assert agent.wait_synced(20.0)
        s.remove(keys[:5])
        assert agent.wait_synced(10.0)
        wait_for(lambda: exactly(clients, keys[5:], keys[:5]), 10.0, "the node synced")
        restart(redis, data=tmp_path / "copy")
        # The node's next events come once the masters write again (events refused meanwhile would make the
        # node resync by chance, whatever the masters knew).
        wait_for(lambda: all(c.ping()["backend"]["state"] == "ok" for c in clients), 20.0)
        s.remove(keys[5:15])
        wait_for(lambda: exactly(clients, keys[15:], keys[:15]), 15.0, "both masters listing the 15 left")
        assert agent.counters["inventories"] >= 2


@pytest.mark.parametrize("loss", ["older_copy", "flushall"])
def test_a_master_that_sees_the_rollback_later_follows_the_new_epoch(tmp_path, redis, make_keys, loss):
    """One master is stopped (SIGSTOP) while Redis is rolled back to an older copy (or flushed: then its
    connections to Redis survive, and nothing but the log itself tells it) and the other master starts a new
    epoch; resumed, it must not serve or append its old history: it follows the new epoch, and both masters
    list exactly what the node holds."""
    with cluster(tmp_path, redis, make_keys) as (ms, s, agent, clients, keys):
        if loss == "older_copy":
            copy_data(redis, tmp_path / "copy")
            wait_for(lambda: all(c.ping()["backend"]["state"] == "ok" for c in clients), 20.0)
        s.remove(keys[:5])
        assert agent.wait_synced(10.0)
        wait_for(lambda: exactly(clients, keys[5:], keys[:5]), 10.0, "the removal applied")
        inventories = agent.counters["inventories"]
        ms[1].pause()
        if loss == "older_copy":
            restart(redis, data=tmp_path / "copy")
        else:
            import redis as redis_py

            with redis_py.Redis.from_url(redis.url) as r:
                r.flushall()
        s.remove(keys[5:15])  # the node's events go to master 0 (master 1 does not answer)
        wait_for(lambda: agent.counters["inventories"] > inventories, 15.0, "the node's full resync")
        assert agent.wait_synced(20.0)
        wait_for(lambda: exactly(clients[:1], keys[15:], keys[:15]), 10.0, "master 0 listing the 15 left")
        ms[1].resume()
        wait_for(lambda: exactly(clients, keys[15:], keys[:15]), 15.0, "both masters listing the 15 left")
        assert len(epochs(clients)) == 1
