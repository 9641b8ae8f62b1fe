"""Every bound and check of the master (test_master_bounds.py, the owned node ids of test_roles.py) holds with
the shared directory too: the same tests, run against a kvtier-master whose state lives in a real redis-server
(``--directory redis://``; a restart reloads it from Redis instead of lmdb). Refusals are decided when the log
entry is applied, by every master alike (master/commands.py)."""

from __future__ import annotations

import pytest

import test_master_bounds as bounds
import test_roles as roles
from redisproc import RedisProcess, needs_redis

pytestmark = needs_redis


@pytest.fixture(autouse=True)
def shared_masters(tmp_path, monkeypatch):
    with RedisProcess(tmp_path) as redis:
        base = bounds.MasterProcess

        class SharedMaster(base):
            """The tests' MasterProcess, its state in the test's Redis instead of a data dir."""

            def __init__(self, tmp, *, data_dir=None, args=(), **kw):
                super().__init__(tmp, data_dir=None, args=(*args, "--directory", redis.url), **kw)

        for module in (bounds, roles):
            monkeypatch.setattr(module, "MasterProcess", SharedMaster)
        yield redis
        import redis as redis_py

        # The test ran against the shared directory: its masters seeded this Redis and logged their writes.
        client = redis_py.Redis.from_url(redis.url)
        assert client.exists("kvtier:epoch") and client.get("kvtier:n") not in (None, b"0")
        client.close()


test_every_field_a_client_sends_has_a_size_limit = bounds.test_every_field_a_client_sends_has_a_size_limit
test_the_node_table_is_bounded_and_dead_nodes_make_room = bounds.test_the_node_table_is_bounded_and_dead_nodes_make_room
test_nodes_with_many_tiers_cannot_widen_every_directory_entry = \
    bounds.test_nodes_with_many_tiers_cannot_widen_every_directory_entry
test_dead_nodes_are_forgotten_after_the_grace_and_stay_forgotten_after_a_restart = \
    bounds.test_dead_nodes_are_forgotten_after_the_grace_and_stay_forgotten_after_a_restart
test_a_node_that_left_does_not_come_back_after_a_restart = \
    bounds.test_a_node_that_left_does_not_come_back_after_a_restart
test_a_stranger_can_neither_say_goodbye_for_a_live_pool_nor_register_over_it = \
    roles.test_a_stranger_can_neither_say_goodbye_for_a_live_pool_nor_register_over_it
keys = roles.keys  # the CurveZMQ keys fixture the quota test needs (per-key limits with the keys' roles)
test_one_key_cannot_take_every_hint_or_node_slot = roles.test_one_key_cannot_take_every_hint_or_node_slot
