"""The shm connection prefaults its mapping of the pool's file (kvtier.hostmem.populate): after attach, a put into
pages this process never touched costs no page faults. Counted with the kernel's minor-fault count of this
process (getrusage), around a put into a real kvtier-pool process's file."""

from __future__ import annotations

import mmap
import resource
from pathlib import Path

import numpy as np

from kvtier.hostmem import populate
from kvtier.keys import Namespace
from kvtier.transport.dial import connect
from poolproc import PoolProcess

BB = 1 << 20
PAGE = mmap.PAGESIZE


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_put_into_untouched_pool_pages_faults_nothing(tmp_path: Path) -> None:
    n = 16
    src = np.random.default_rng(1).integers(0, 255, n * BB, dtype=np.uint8)
    out = np.zeros_like(src)
    rows = lambda a: np.uint64(a.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(BB)  # noqa: E731
    src_rows, out_rows = rows(src), rows(out)
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity=str(4 * n * BB), block_bytes=BB) as pool:
        conn = connect(pool.ipc, BB, transport="shm", timeout_s=10.0)
        try:
            mapping = conn._mapping  # noqa: SLF001 - the mapping under test
            assert mapping is not None and mapping.populated.wait(30), "the prefault did not finish"
            keys = Namespace("prefault").keys(range(n))
            before = _minor_faults()
            assert all(conn.put(keys, src_rows))
            faults = _minor_faults() - before
            assert all(conn.get(keys, out_rows))
        finally:
            conn.close()
    assert np.array_equal(out, src)
    # Without the prefault every 4 KiB page of the 16 MiB written faults once (4,096 faults); a few remain for the
    # call's own Python objects.
    assert faults < n * BB // PAGE // 8, faults


def test_populate_faults_every_page_in_once() -> None:
    nbytes = 8 << 20

    class Owner:
        def __init__(self) -> None:
            self.mm = mmap.mmap(-1, nbytes)

    owner = Owner()
    assert populate(owner, lambda o: o.mm, nbytes, "test mapping").wait(10)
    view = np.frombuffer(owner.mm, dtype=np.uint8)
    before = _minor_faults()
    view[::PAGE] = 1  # one write per page
    assert _minor_faults() - before < nbytes // PAGE // 8
    del view
