"""A distributed store whose kvtier-master does not answer (SIGSTOP: the socket connects, no reply comes): one
timeout, then a back-off in which pool calls are misses at once, callers queued behind the failing call fail
with it, DRAM and SSD hits never wait on the master, and the first answer after the back-off ends it."""

from __future__ import annotations

import threading
import time

import pytest

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.client import MasterTimeout
from kvtier.store import TieredStore
from kvtier.tiers.dram import DramTier
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.pool_route import MasterBackoff, MasterRoute
from kvtier.tiers.ssd import DiskTier
from kvtier.transport.base import PoolUnavailable
from masterproc import MasterProcess
from poolproc import until

BB = 4096


@pytest.fixture
def paused_master(tmp_path):
    with MasterProcess(tmp_path) as mp:
        mp.pause()
        yield mp
        mp.resume()


def test_backoff_grows_caps_and_resets_on_an_answer():
    now = [100.0]  # the back-off's clock: moved by the test, never slept on
    b = MasterBackoff("tcp://nowhere:1", first_s=0.01, max_s=0.04, clock=lambda: now[0])
    calls = []

    def dead():
        calls.append(1)
        raise MasterTimeout("timeout", "no reply")

    lengths = []
    for _ in range(4):
        now[0] += b.stats()["backoff_left_s"]
        assert b.stats()["backoff_left_s"] == 0
        with pytest.raises(PoolUnavailable):
            b.call(dead, "locate")
        lengths.append(b.stats()["backoff_s"])
        with pytest.raises(PoolUnavailable) as skipped:  # inside the back-off: fails without calling
            b.call(dead, "locate")
        assert skipped.value.code == "backoff"
    assert lengths == [0.01, 0.02, 0.04, 0.04]
    assert len(calls) == 4 and b.stats()["skipped"] == 4 and not b.stats()["up"]
    now[0] += 0.04
    assert b.call(lambda: "ok", "locate") == "ok"
    assert b.stats()["up"] and b.stats()["backoff_s"] == 0
    with pytest.raises(PoolUnavailable):
        b.call(dead, "locate")
    assert b.stats()["backoff_s"] == 0.01  # an answer reset the back-off to its first length


def test_after_a_backoff_a_probe_asks_the_master_and_callers_never_wait():
    answering = threading.Event()
    probes: list[str] = []

    def probe():
        probes.append(threading.current_thread().name)
        if not answering.is_set():
            raise MasterTimeout("timeout", "no reply")
        return {"ok": True}

    def dead():
        raise MasterTimeout("timeout", "no reply")

    now = [100.0]  # the back-off's clock, moved by the test: the waits below are for the probe thread's counters
    b = MasterBackoff("tcp://nowhere:1", first_s=0.01, max_s=0.02, probe=probe, clock=lambda: now[0])
    with pytest.raises(PoolUnavailable):
        b.call(dead, "locate")  # the first failure: this caller's own call
    ran: list[int] = []

    def try_call() -> str | None:
        try:
            return b.call(lambda: ran.append(1) or "ok", "locate")
        except PoolUnavailable as e:
            assert e.code == "backoff"
            return None

    others = set(threading.enumerate())  # probe threads of other tests' routes do not count

    def probing() -> bool:  # this back-off's probe thread is still running (it must end before the next starts)
        return any(t.name == "kvtier-master-probe" and t not in others for t in threading.enumerate())

    # While the master is down no caller runs its call (none waits a timeout): probes ask, on their own thread.
    for n in range(1, 4):
        assert try_call() is None  # inside the back-off: no probe either
        now[0] += 1.0  # the back-off has run out
        assert try_call() is None  # this caller goes on at once; a probe asks
        assert until(lambda: b.stats()["failures"] == 1 + n and not probing(), 10, 0.002)  # failed: a back-off
        assert len(probes) == n
    assert ran == [] and set(probes) == {"kvtier-master-probe"} and not b.stats()["up"]
    answering.set()
    now[0] += 1.0
    assert try_call() is None  # the probe that will get the answer starts
    assert until(lambda: b.stats()["up"], 10, 0.002)
    assert try_call() == "ok"  # a probe got an answer: calls go through again
    assert ran == [1] and b.stats()["backoff_s"] == 0


def test_concurrent_callers_fail_with_the_call_they_queued_behind(paused_master, make_keys):
    mp = paused_master
    store = TieredStore.from_config({"mode": "distributed", "master": mp.endpoint, "node_id": "n1",
                                     "dram_capacity": 64 * BB, "pool_timeout_ms": 1500}, BB)
    route = store.tiers[1].route
    try:
        start = threading.Barrier(4)
        results: list[list[bool]] = []

        def one(i: int) -> None:
            start.wait()
            results.append(store.contains(make_keys(8, 100 * i)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [[False] * 8] * 4
        s = route.stats()
        # One caller waited out the timeout; the three queued behind it failed with it, not after it in turn.
        assert (s["calls"], s["failures"], s["skipped"], s["up"]) == (1, 1, 3, False)
        seen = store.stats()["tiers"]["pool"]["extra"]["route"]  # what an operator sees in the store's stats
        assert (seen["failures"], seen["skipped"], seen["up"]) == (1, 3, False)

        mp.resume()  # answering again: the first call after the back-off ends it
        assert until(lambda: store.contains(make_keys(1)) is not None and route.stats()["up"])
        assert route.stats()["backoff_s"] == 0
    finally:
        store.close()


def test_dram_and_ssd_hits_never_wait_on_a_dead_master(paused_master, make_keys, tmp_path):
    route = MasterRoute(paused_master.endpoint, "n1", timeout_s=0.2, backoff_s=(0.05, 0.1))  # probes run
    locates: list[str] = []
    real_locate = route._client.locate
    route._client.locate = lambda *a, **kw: locates.append(threading.current_thread().name) or real_locate(*a, **kw)
    tiers = [DramTier(16 * BB, BB), PoolTier(BB, route, staging_bytes=0),
             DiskTier(tmp_path / "ssd", 8 << 20, BB, segment_bytes=1 << 20, direct_io="false")]
    store = TieredStore(tiers, offload=["write_through", "write_through"])
    try:
        keys = make_keys(8)
        data = blocks_for(keys, BB)
        assert store.put(keys, data).stored == 8  # asks the master nothing (a put asks no remote tier)
        assert store.flush(30)
        # The write-through's placement is the one call that times out; no locate was asked.
        assert route.stats()["failures"] == 1 and locates == []
        locates.clear()
        for _ in range(20):
            tiers[0].remove(keys[4:])  # half in DRAM (and SSD), half on the SSD only (a get promotes them)
            out = data.clone().zero_()
            assert_all_hits_exact(store.get(keys, out), out, data)
            time.sleep(0.05)  # back-offs run out meanwhile: probes ask the master, never a get
        s = route.stats()
        assert s["failures"] >= 2 and s["skipped"] >= 20  # each SSD read skipped the master
        assert locates == []  # no get asked the master (and so none waited out its timeout)
    finally:
        store.close()
