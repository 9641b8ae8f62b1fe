"""The shm transport's copy threads (pool_copy_threads): by the rates measured for its puts and its gets by
default, as configured otherwise, against a real kvtier-pool process; bytes checked either way."""

import numpy as np
import pytest
import torch

from bytecheck import assert_all_hits_exact
from kvtier import TieredStore
from kvtier.memory import hostcopy
from kvtier.config import Config, ConfigError
from kvtier.keys import Namespace
from kvtier.pool.process import PoolDaemon
from kvtier.transport import connect

BB = 256 << 10
SMALL = 2  # blocks: 512 KiB, under PARALLEL_MIN_BYTES
BIG = 8  # blocks: 2 MiB, at or over it
assert SMALL * BB < hostcopy.PARALLEL_MIN_BYTES <= BIG * BB


def _recording(monkeypatch):
    seen: list[int] = []
    real = hostcopy.copy_rows

    def copy_rows(dst, src, nbytes, threads=1):
        seen.append(threads)
        real(dst, src, nbytes, threads)

    monkeypatch.setattr(hostcopy, "copy_rows", copy_rows)
    return seen


def _put_get(conn, n: int, start: int) -> None:
    src = (np.arange(n * BB, dtype=np.uint32) * 7 + start).astype(np.uint8).reshape(n, BB)
    out = np.zeros_like(src)
    keys = Namespace("shm-threads").keys(range(start, start + n))
    offs = np.arange(n, dtype=np.uint64) * np.uint64(BB)
    assert conn.put(keys, np.uint64(src.ctypes.data) + offs) == [True] * n
    assert_all_hits_exact(conn.get(keys, np.uint64(out.ctypes.data) + offs), out, src)
    conn.remove(keys)


@pytest.mark.parametrize("configured,faster", [(0, 1), (0, 2), (1, 2), (2, 1)])
def test_shm_copies_use_the_configured_or_measured_threads(monkeypatch, configured, faster):
    monkeypatch.setattr(hostcopy, "_CORES", 2)
    monkeypatch.setattr(hostcopy, "REPROBE_S", 1e9)  # however slow this machine, the fed rates decide
    seen = _recording(monkeypatch)
    with PoolDaemon(4 * BIG * BB, BB, ipc=True) as pool:
        conn = connect(pool.endpoint("ipc"), BB, transport="shm", timeout_s=10.0, copy_threads=configured)
        try:
            for copies in (conn.put_copies, conn.get_copies):  # what this host measured, fed (no timing)
                for threads in (1, 2):
                    for _ in range(hostcopy.PROBE_BATCHES):
                        copies.record(threads, BIG * BB, 1.0 if threads == faster else 3.0)
            _put_get(conn, SMALL, 0)
            small, seen[:] = list(seen), []
            _put_get(conn, BIG, 100)
            big = list(seen)
        finally:
            conn.close()
    assert small and big  # a put and a get copied each time
    assert set(small) == {configured or 1}
    assert set(big) == {configured or faster}


def test_shm_connection_probes_each_choice_before_it_decides(monkeypatch):
    monkeypatch.setattr(hostcopy, "_CORES", 2)
    seen = _recording(monkeypatch)
    with PoolDaemon(4 * BIG * BB, BB, ipc=True) as pool:
        conn = connect(pool.endpoint("ipc"), BB, transport="shm", timeout_s=10.0)
        try:
            _put_get(conn, BIG, 0)
        finally:
            conn.close()
    # This small pool takes requests of 4 blocks (1 MiB, wire MIN_REQUEST_BLOCKS): the put copies two chunks,
    # then the get: each direction measures one thread first, then two, apart from the other.
    assert seen == [1, 2, 1, 2]
    assert all(c.rate(t, BIG * BB) > 0 for c in (conn.put_copies, conn.get_copies) for t in (1, 2))


def test_pool_copy_threads_config_reaches_the_shm_connection(monkeypatch):
    monkeypatch.setattr(hostcopy, "_CORES", 2)
    seen = _recording(monkeypatch)
    with PoolDaemon(4 * BIG * BB, BB, ipc=True) as pool:
        store = TieredStore.from_config({"mode": "standalone", "pool": pool.endpoint("ipc"), "pool_copy_threads": 1,
                                         "pool_staging_bytes": 0}, BB)
        try:
            keys = Namespace("shm-threads-cfg").keys(range(BIG))
            src = (np.arange(BIG * BB, dtype=np.uint32) % 251).astype(np.uint8).reshape(BIG, BB)
            store.put(keys, torch.from_numpy(src))
            assert seen and set(seen) == {1}
        finally:
            store.close()


def test_pool_copy_threads_out_of_range_is_a_load_time_error():
    with pytest.raises(ConfigError, match="pool_copy_threads"):
        Config.from_dict({"pool_copy_threads": -1})
    with pytest.raises(ConfigError, match="pool_copy_threads"):
        Config.from_dict({"pool_copy_threads": 17})
