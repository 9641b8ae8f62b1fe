"""PoolTier in a TieredStore (distributed mode without a master: a static list of pools): blocks spread over
the pools by rendezvous hashing, another engine's store finds them, a dead or stopped pool is a miss within
the timeout and is skipped afterwards, write-behind blocks are readable before they are sent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheck import assert_all_hits_exact, assert_no_wrong_bytes
from conftest import blocks_for
from kvtier.config import ConfigError
from kvtier.keys import Namespace
from kvtier.store import TieredStore
from kvtier.tiers import pool as pool_module
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.pool_route import PeerRoute
from poolproc import PoolProcess, finishes

BB = 16 << 10


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pools")
    with PoolProcess(tmp, name="p1", capacity="8MiB") as p1, PoolProcess(tmp, name="p2", capacity="8MiB") as p2:
        yield p1, p2


def store_for(pools, **extra) -> TieredStore:
    config = {"mode": "distributed", "pool": ",".join(p.tcp for p in pools), "dram_capacity": 64 * BB,
              "pool_timeout_ms": 500, **extra}
    return TieredStore.from_config(config, BB)


def pool_tier(store: TieredStore) -> PoolTier:
    tier = store.tiers[1]
    assert isinstance(tier, PoolTier)
    return tier


def test_write_through_spreads_blocks_over_the_pools_and_another_engine_finds_them(pools, make_keys):
    keys = make_keys(40, start=0)
    with store_for(pools) as a, store_for(pools, pool_promote=True) as b:
        assert [t.name for t in a.tiers] == ["dram", "pool"]
        assert a.put(keys, blocks_for(keys, BB)).stored == 40
        assert a.flush(5.0)
        per_pool = pool_tier(a).stats().extra["pools"]
        assert set(per_pool) == {p.tcp for p in pools} and all(v["up"] for v in per_pool.values())
        # Each key sits in exactly one pool (rendezvous), and both pools got some.
        counts = [sum(held_in(p, keys)) for p in pools]
        assert sum(counts) == 40 and min(counts) > 0
        # Another engine: its DRAM is empty, its pool tier finds every block, bytes exact, promoted to DRAM.
        assert b.lookup_prefix(keys).runs == [("pool", 40)]
        out = torch.empty(40, BB, dtype=torch.uint8)
        assert_all_hits_exact(b.get(keys, out), out, blocks_for(keys, BB))
        assert b.stats()["offloads"]["pool"]["promoted"] == 40
        assert b.lookup_prefix(keys).runs == [("dram", 40)]


def test_on_evict_sends_only_what_dram_drops(pools, make_keys):
    keys = make_keys(100, start=1000)
    with store_for(pools, pool_offload="on_evict") as s:
        for i in range(0, 100, 20):
            assert s.put(keys[i:i + 20], blocks_for(keys[i:i + 20], BB)).stored == 20
        assert s.flush(5.0)
        assert s.stats()["offloads"]["pool"]["written"] == 100 - 64  # only the evicted ones went down
        out = torch.empty(100, BB, dtype=torch.uint8)
        assert_all_hits_exact(s.get(keys, out), out, blocks_for(keys, BB))


@pytest.mark.slow  # two pools, one SIGSTOPped: a call waits out its timeout
def test_a_dead_pool_is_a_miss_within_the_timeout_then_skipped(tmp_path, make_keys, monkeypatch):
    with PoolProcess(tmp_path, name="d1", capacity="4MiB") as p1, \
            PoolProcess(tmp_path, name="d2", capacity="4MiB") as p2:
        keys = make_keys(30, start=2000)
        with store_for([p1, p2], dram_capacity=8 * BB) as writer:
            for i in range(0, 30, 5):
                writer.put(keys[i:i + 5], blocks_for(keys[i:i + 5], BB))
            assert writer.flush(5.0)
        on_p2 = held_in(p2, keys)
        assert 0 < sum(on_p2) < 30
        p2.pause()  # SIGSTOP: connected but silent, the worst case
        # A back-off far longer than the test, so "still in its back-off" does not depend on the machine's speed.
        monkeypatch.setattr(pool_module, "BACKOFF_S", (60.0, 60.0))
        with store_for([p1, p2]) as reader:
            out = torch.empty(30, BB, dtype=torch.uint8)
            hit = finishes(lambda: reader.get(keys, out))  # a timed-out call, never a hang
            assert hit == [not x for x in on_p2]  # p1's blocks still come back; p2's are misses
            assert_no_wrong_bytes(hit, out, blocks_for(keys, BB))
            tier = pool_tier(reader)
            assert not tier.stats().extra["pools"][p2.tcp]["up"]
            down_until = tier._pools[p2.tcp].health.down_until  # set by the failed call
            assert reader.get(keys, out) == hit
            # p2 is in its back-off: not called again (a call would have failed and moved its back-off).
            assert tier._pools[p2.tcp].health.down_until == down_until
        p2.resume()


EXITING_ENGINE = r"""
import atexit, json, logging, sys
sys.path.insert(0, sys.argv[2])
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from conftest import blocks_for
from kvtier import TieredStore
from kvtier.keys import Namespace
keys = Namespace("pool-exit").keys(range(64))
s = TieredStore.from_config(json.loads(sys.argv[1]), 16 << 10)
assert s.put(keys, blocks_for(keys, 16 << 10)).stored == 64
atexit.register(s.close)  # closed after the main thread ended, as by an atexit handler or a finalizer
"""


def test_a_close_while_the_interpreter_exits_writes_dram_down_to_every_pool(pools):
    """on_evict, nothing evicted: the close writes DRAM's 64 blocks down, spread over the two pools. Closed from an
    atexit handler, after concurrent.futures stopped its thread pools: the per-pool fan-out was refused then
    ("cannot schedule new futures after interpreter shutdown": 0 written); now it runs on the closing thread."""
    keys = Namespace("pool-exit").keys(range(64))
    config = {"mode": "distributed", "pool": ",".join(p.tcp for p in pools), "dram_capacity": 64 * BB,
              "pool_timeout_ms": 2000, "pool_offload": "on_evict"}
    r = subprocess.run([sys.executable, "-c", EXITING_ENGINE, json.dumps(config), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "close: wrote 64 DRAM blocks" in r.stderr, r.stderr
    counts = [sum(held_in(p, keys)) for p in pools]
    assert sum(counts) == 64 and min(counts) > 0, counts
    with store_for(pools) as s:
        out = torch.empty(64, BB, dtype=torch.uint8)
        assert_all_hits_exact(s.get(keys, out), out, blocks_for(keys, BB))


def test_write_behind_blocks_are_readable_before_they_are_sent(tmp_path, make_keys):
    with PoolProcess(tmp_path, name="wb", capacity="4MiB") as p:
        keys = make_keys(8, start=3000)
        with store_for([p], pool_timeout_ms=3000) as s:
            tier = pool_tier(s)
            assert tier.contains(keys[:1]) == [False]  # connected
            p.pause()
            future = tier.put_later(keys, blocks_for(keys, BB), wait=False)  # returns at once
            assert tier.contains(keys) == [True] * 8  # staged
            out = torch.empty(8, BB, dtype=torch.uint8)
            assert_all_hits_exact(tier.get(keys, out), out, blocks_for(keys, BB))
            p.resume()
            assert sorted(future.result(10)) == sorted(keys)
            assert tier.stats().extra["write_behind"]["sent"] == 8


@pytest.mark.parametrize("config, message", [
    ({"mode": "standalone"}, "needs exactly one 'pool' endpoint"),
    ({"mode": "standalone", "pool": "ipc:///x", "ssd_path": "/tmp/x"}, "keeps no SSD tier"),
    ({"mode": "distributed"}, "needs 'master' (kvtier-master) or 'pool'"),
    ({"pool": "tcp://a:1"}, "mode is 'embedded'"),
    ({"mode": "distributed", "pool": "a:1"}, "'a:1' is not a tcp://host:port or ipc:///path endpoint"),
    ({"mode": "distributed", "pool": "tcp://a:1", "pool_timeout_ms": 0}, "pool_timeout_ms must be in 1..60000"),
    ({"mode": "clustered"}, "mode: 'clustered' is not one of embedded, standalone, distributed"),
])
def test_mode_settings_are_checked(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TieredStore.from_config(config, BB)


def held_in(pool: PoolProcess, keys: list[bytes]) -> list[bool]:
    """Which keys one pool holds, asked directly."""
    tier = PoolTier(BB, PeerRoute([pool.tcp]), staging_bytes=0)
    try:
        return tier.contains(keys)
    finally:
        tier.close()


@given(ops=st.lists(st.tuples(st.sampled_from(["add", "drop"]), st.lists(st.integers(0, 63), max_size=8)),
                    max_size=30))
@settings(max_examples=200, deadline=None)
def test_recently_held_keys_never_claim_a_key_that_was_not_added(ops):
    """The local filter may forget (a slot taken by another key) but never invents: a key reported held was
    added and not dropped since."""
    from kvtier.keys import Namespace
    from kvtier.tiers.pool_recent import RecentlyHeld as _Recent

    keys = Namespace("recent").keys(range(64))
    recent = _Recent(slots=16)  # tiny: collisions happen
    truth: set[bytes] = set()
    for op, idx in ops:
        batch = [keys[i] for i in idx]
        if op == "add":
            recent.add(batch)
            truth.update(batch)
        else:
            recent.drop(batch)
            truth.difference_update(batch)
        for k, h in zip(keys, recent.has(keys)):
            assert not h or k in truth
    recent.add(keys[:1])
    assert recent.has(keys[:1]) == [True]  # the latest key of a slot is always remembered


def test_pool_promote_switches_pool_promotion_alone(pools, make_keys, tmp_path):
    # pool_promote=false: a block served from a pool stays there (DRAM gets no copy), while the SSD below still
    # promotes (ssd_promote true): before pool_promote, ssd_promote was the one switch for both.
    keys = make_keys(8, start=5000)
    with store_for(pools) as writer:
        assert writer.put(keys, blocks_for(keys, BB)).stored == 8
        assert writer.flush(5.0)
    with store_for(pools, pool_promote=False, ssd_promote=True, ssd_path=str(tmp_path / "ssd"), ssd_capacity=64 * BB,
                   ssd_segment_bytes=16 * BB, ssd_direct_io="false", ssd_fsync=False) as reader:
        offloads = reader.stats()["offloads"]
        assert (offloads["pool"]["promote"], offloads["ssd"]["promote"]) == (False, True)
        out = torch.empty(8, BB, dtype=torch.uint8)
        assert_all_hits_exact(reader.get(keys, out), out, blocks_for(keys, BB))
        assert reader.stats()["offloads"]["pool"].get("promoted", 0) == 0
        assert reader.lookup_prefix(keys).runs == [("pool", 8)]
    with store_for(pools, pool_promote=True) as promoting:  # the control: the same get promotes
        assert promoting.get(keys, out) == [True] * 8
        assert promoting.stats()["offloads"]["pool"]["promoted"] == 8
        assert promoting.lookup_prefix(keys).runs == [("dram", 8)]
