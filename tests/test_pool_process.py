"""PoolDaemon (pool/process.py), the pool helper of the benches and ``kvtier replay --pool``: a real
kvtier-pool subprocess whose DRAM file lives in memory (/dev/shm), in a directory of its own, removed on exit;
where /dev/shm is missing it falls back to its temp dir and says so."""

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from bytecheck import assert_all_hits_exact
from kvtier.keys import Namespace
from kvtier.pool import process
from kvtier.pool.process import PoolDaemon
from kvtier.transport import connect

BB = 4096


def _round_trip(pool: PoolDaemon) -> None:
    """Put two blocks over shm and read them back: the pool sizes and maps its DRAM file on the way."""
    conn = connect(pool.endpoint("ipc"), BB, transport="shm", timeout_s=10.0)
    try:
        src = np.arange(2 * BB, dtype=np.uint32).astype(np.uint8).reshape(2, BB)
        out = np.zeros_like(src)
        keys = Namespace("pool-process").keys(range(2))
        rows = np.uint64(src.ctypes.data) + np.arange(2, dtype=np.uint64) * np.uint64(BB)
        assert conn.put(keys, rows) == [True, True]
        hit = conn.get(keys, np.uint64(out.ctypes.data) + np.arange(2, dtype=np.uint64) * np.uint64(BB))
        assert_all_hits_exact(hit, out, src)
    finally:
        conn.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="this host has no /dev/shm")
def test_pool_dram_file_is_in_dev_shm_and_removed_on_exit():
    with PoolDaemon(16 * BB, BB, ipc=True) as pool, PoolDaemon(16 * BB, BB, ipc=True) as other:
        assert pool.shm_dir is not None and other.shm_dir is not None
        shm_dir = pool.shm_dir
        assert shm_dir.parent == Path("/dev/shm")
        assert shm_dir != other.shm_dir  # two daemons at once (two engineers, two benches) never share a file
        _round_trip(pool)
        files = [p.name for p in shm_dir.iterdir()]
        assert any(name.endswith(".shm") for name in files), files
        assert not any(p.name.endswith(".shm") for p in pool._dir.iterdir())  # nothing on the temp dir's disk
    assert not shm_dir.exists()
    assert pool.shm_dir is None


def test_pool_without_dev_shm_falls_back_to_its_temp_dir_and_logs(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(process, "SHM_ROOT", str(tmp_path / "no-shm-here"))
    with caplog.at_level(logging.WARNING, logger="kvtier.pool.process"):
        with PoolDaemon(16 * BB, BB, ipc=True) as pool:
            temp = pool._dir
            assert pool.shm_dir == temp
            _round_trip(pool)
            assert any(p.name.endswith(".shm") for p in temp.iterdir())
    assert "does not exist here" in caplog.text
    assert not temp.exists()


def test_an_interrupt_while_the_pool_starts_stops_it_and_removes_its_directories(monkeypatch):
    """A Ctrl-C (KeyboardInterrupt) in the wait for the ready file: ``with`` calls no __exit__ for a failed
    __enter__, so __enter__ itself must stop the process and remove its directories."""
    pool = PoolDaemon(1 << 20, BB)
    started = []
    real_popen = process.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    real_sleep = process.time.sleep
    raised = []

    def interrupted(s):  # the first sleep is the wait's (the time module is shared: later ones are real)
        if len(started) == 1 and not raised:
            raised.append(s)
            raise KeyboardInterrupt
        real_sleep(s)

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    monkeypatch.setattr(process.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with pool:
            pass
    proc = started[0]
    assert proc.poll() is not None  # stopped (and reaped), not left running
    assert pool.shm_dir is None and pool._dir is None
    assert not [d for d in Path("/dev/shm").glob(f"kvtier-pool-{os.getpid()}-*")]
