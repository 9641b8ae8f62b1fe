"""The shm connection prefaults its mapping of the pool's file (kvtier.memory.hostmem.populate): after attach, a put
into pages this process never touched costs no page faults. Counted with the kernel's minor-fault count of this
process (getrusage), around a put into a real kvtier-pool process's file. And the mapping is on the file's huge
pages where the kernel allows (MADV_COLLAPSE), read back from the kernel (/proc/self/smaps)."""

from __future__ import annotations

import logging
import mmap
import resource
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvtier.memory import hostmem
from kvtier.memory.hostmem import populate
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


def _collapse_refused(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "MADV_COLLAPSE" in r.getMessage()]


@pytest.mark.parametrize("where", ["tmpfs", "disk"])
def test_the_clients_mapping_of_the_pools_file_is_on_huge_pages_where_the_file_is_on_tmpfs(
        tmp_path: Path, caplog, where: str) -> None:
    """The pool collapses its file onto 2 MiB pages and the client maps them at an aligned address (one page-table
    entry each), under the shmem setting ``never`` too (MADV_COLLAPSE); a pool whose file is on a disk file system
    (``--shm-dir`` there) keeps 4 KiB pages."""
    caplog.set_level(logging.INFO, "kvtier.memory.hostmem")
    n = 8
    shm_dir = Path(tempfile.mkdtemp(prefix="kvtier-test-huge-", dir="/dev/shm" if where == "tmpfs" else tmp_path))
    if (hostmem.mount_of(shm_dir)[0] == "tmpfs") != (where == "tmpfs"):  # a machine whose /tmp is a tmpfs
        shutil.rmtree(shm_dir, ignore_errors=True)
        pytest.skip(f"{shm_dir} is not on the file system this case needs ({where})")
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity=str(n * BB), block_bytes=BB,
                     args=("--shm-dir", str(shm_dir))) as pool:
        conn = connect(pool.ipc, BB, transport="shm", timeout_s=10.0)
        try:
            mapping = conn._mapping  # noqa: SLF001 - the mapping under test
            assert mapping is not None and mapping.base % hostmem.HUGE_ALIGN == 0
            assert mapping.populated.wait(30), "the collapse and prefault did not finish"
            src = np.random.default_rng(2).integers(0, 255, n * BB, dtype=np.uint8)
            out = np.zeros_like(src)
            rows = lambda a: np.uint64(a.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(BB)  # noqa: E731
            keys = Namespace("huge").keys(range(n))
            assert all(conn.put(keys, rows(src))) and all(conn.get(keys, rows(out)))
            pages = conn.pages()
        finally:
            conn.close()
    shutil.rmtree(shm_dir, ignore_errors=True)
    assert np.array_equal(out, src)  # the same bytes whatever the pages
    if where == "disk":
        assert pages == "4 KiB" and not _collapse_refused(caplog)
    else:  # a kernel before 6.1 (or shmem huge pages denied) refuses, in one log line: 4 KiB pages
        assert pages.startswith("2 MiB (THP") or len(_collapse_refused(caplog)) == 1, (pages, caplog.text)
