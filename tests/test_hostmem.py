"""HostBuffer's pages: huge pages where the kernel's settings allow them, normal pages and one log line where
they do not (never a failed start), and the page size read back from the kernel."""

import logging
import re
from pathlib import Path

import pytest

from kvtier.memory import hostmem
from kvtier.memory.hostmem import HostBuffer

MIB = 1 << 20


def _vm_flags(ptr: int) -> set[str]:
    """The kernel's flags of the mapping holding ``ptr`` ("hg": advised MADV_HUGEPAGE)."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(x, 16) for x in entry.split(None, 1)[0].split("-"))
        if start <= ptr < end:
            return set(re.search(r"^VmFlags:(.*)$", entry, re.M).group(1).split())
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _setting(tmp_path: Path, name: str, text: str | None) -> str:
    path = tmp_path / name
    if text is not None:
        path.write_text(text + "\n")
    return str(path)  # a missing file: a kernel or container without the setting


def _huge_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier.memory.hostmem"]


@pytest.mark.parametrize("setting,advised", [("always [madvise] never", True), ("[always] madvise never", True),
                                             ("always madvise [never]", False), (None, False)])
def test_private_buffer_is_advised_huge_only_where_thp_allows(tmp_path, monkeypatch, caplog, setting, advised):
    monkeypatch.setattr(hostmem, "THP_ENABLED", _setting(tmp_path, "enabled", setting))
    caplog.set_level(logging.INFO, "kvtier.memory.hostmem")
    buf = HostBuffer(8 * MIB, prefault=True)
    try:
        assert ("hg" in _vm_flags(buf.ptr)) == advised
        buf.tensor.fill_(7)  # usable either way
        assert int(buf.tensor[::MIB].sum()) == 7 * 8
        logs = _huge_logs(caplog)
        if advised:
            assert not logs
        else:
            assert len(logs) == 1 and "normal pages" in logs[0]
            assert buf.pages() == "4 KiB"
    finally:
        buf.close()


def test_huge_pages_off_by_the_caller_advises_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(hostmem, "THP_ENABLED", _setting(tmp_path, "enabled", "[always] madvise never"))
    buf = HostBuffer(4 * MIB, huge_pages=False)
    assert "hg" not in _vm_flags(buf.ptr)


@pytest.mark.parametrize("setting,advised,collapsed", [("always within_size [advise] never deny force", True, True),
                                                       ("always within_size advise [never] deny force", False, True),
                                                       (None, False, True),
                                                       ("always within_size advise never [deny] force", False, False)])
def test_shared_file_is_advised_huge_where_shmem_allows_and_collapsed_unless_it_denies(
        tmp_path, monkeypatch, caplog, setting, advised, collapsed):
    monkeypatch.setattr(hostmem, "THP_SHMEM", _setting(tmp_path, "shmem_enabled", setting))
    caplog.set_level(logging.INFO, "kvtier.memory.hostmem")
    path = Path("/dev/shm") / f"kvtier-test-hostmem-{id(caplog)}"
    try:
        buf = HostBuffer(4 * MIB + 4096, shm_path=path, prefault=True)
        assert path.stat().st_size == 4 * MIB + 4096 and buf.tensor.numel() == 4 * MIB + 4096
        assert buf.ptr % hostmem.HUGE_ALIGN == 0  # where a huge page of the file can map with one entry
        assert ("hg" in _vm_flags(buf.ptr)) == advised
        buf.tensor.fill_(5)  # usable whatever the pages
        assert int(buf.tensor[::MIB].sum()) == 5 * 5
        if not collapsed:
            assert buf.populated is None
            logs = _huge_logs(caplog)
            assert len(logs) == 1 and "normal pages" in logs[0] and "shmem huge pages are deny" in logs[0], logs
            return
        assert buf.populated is not None and buf.populated.wait(30)
        refused = [m for m in _huge_logs(caplog) if "MADV_COLLAPSE" in m]
        # MADV_COLLAPSE (Linux 6.1) moves the file's whole 2 MiB pages onto huge pages even under ``never``; a
        # kernel without it says so in one line and the buffer keeps working on normal pages
        assert buf.pages().startswith("2 MiB (THP") or len(refused) == 1, (buf.pages(), _huge_logs(caplog))
        assert len(_huge_logs(caplog)) == len(refused)
    finally:
        path.unlink(missing_ok=True)


def test_a_missing_hugetlbfs_or_mount_table_never_fails_a_start(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(hostmem, "MOUNTS", str(tmp_path / "no-mounts"))  # a container without /proc/self/mounts
    monkeypatch.setattr(hostmem, "THP_SHMEM", str(tmp_path / "no-thp"))
    caplog.set_level(logging.INFO, "kvtier.memory.hostmem")
    path = tmp_path / "not-yet" / "hugepages" / "pool.dram"  # the configured directory does not exist yet
    buf = HostBuffer(2 * MIB, shm_path=path)
    assert path.stat().st_size == 2 * MIB
    # without the shmem setting the collapse is tried: huge pages, or one line saying the kernel refused
    assert buf.populated is not None and buf.populated.wait(30)
    assert buf.pages() == "2 MiB (THP)" or (buf.pages() == "4 KiB" and len(_huge_logs(caplog)) == 1), \
        (buf.pages(), _huge_logs(caplog))


def test_hugetlbfs_mounts_are_found_by_longest_prefix(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("tmpfs /dev/shm tmpfs rw,relatime 0 0\n"
                      "hugetlbfs /mnt/huge hugetlbfs rw,relatime,pagesize=2M 0 0\n"
                      "hugetlbfs /mnt/huge/1g hugetlbfs rw,pagesize=1024M 0 0\n"
                      "tmpfs /mnt/huge/plain tmpfs rw 0 0\n")
    assert hostmem.hugetlbfs_page(Path("/mnt/huge/kvtier"), str(mounts)) == 2 * MIB
    assert hostmem.hugetlbfs_page(Path("/mnt/huge/1g/x"), str(mounts)) == 1 << 30
    assert hostmem.hugetlbfs_page(Path("/mnt/huge/plain/x"), str(mounts)) == 0
    assert hostmem.hugetlbfs_page(Path("/mnt/hugepages"), str(mounts)) == 0  # a prefix of a name is not a mount
    assert hostmem.hugetlbfs_page(Path("/dev/shm"), str(mounts)) == 0


def test_page_size_is_read_back_from_smaps(tmp_path):
    def smaps(*entries: str) -> str:
        path = tmp_path / "smaps"
        path.write_text("\n".join(entries) + "\n")
        return str(path)

    def entry(start: int, size_kb: int, **fields: int) -> str:
        return "\n".join([f"{start:x}-{start + size_kb * 1024:x} rw-s 00000000 00:05 1 /x",
                          *(f"{k}: {v:>8} kB" for k, v in fields.items()), "VmFlags: rd wr"])

    base = 0x7F0000000000
    huge = smaps(entry(base, 4096, KernelPageSize=2048, Rss=4096))
    assert hostmem.page_sizes(base, 4 * MIB, huge) == "2 MiB (hugetlbfs)"
    half = smaps(entry(base, 4096, KernelPageSize=4, Rss=4096, AnonHugePages=2048))
    assert hostmem.page_sizes(base, 4 * MIB, half) == "2 MiB (THP, 50% of 4 MiB resident)"
    full = smaps(entry(base - 4096 * 1024, 4096, Rss=4096, AnonHugePages=4096),  # another mapping: not counted
                 entry(base, 4096, KernelPageSize=4, Rss=4096, ShmemPmdMapped=4096))
    assert hostmem.page_sizes(base, 4 * MIB, full) == "2 MiB (THP)"
    small = smaps(entry(base, 4096, KernelPageSize=4, Rss=4096, AnonHugePages=0))
    assert hostmem.page_sizes(base, 4 * MIB, small) == "4 KiB"
    advised = smaps(entry(base, 4096, KernelPageSize=4, Rss=0).replace("VmFlags: rd wr", "VmFlags: rd wr hg"))
    assert hostmem.page_sizes(base, 4 * MIB, advised) == "2 MiB (THP advised, none resident yet)"
    assert hostmem.page_sizes(base, 4 * MIB, str(tmp_path / "absent")) == "unknown"


def test_shared_mapping_is_aligned_and_lives_as_long_as_a_view(tmp_path):
    import gc
    import os

    import numpy as np

    path = Path("/dev/shm") / f"kvtier-test-mapping-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 3 * MIB + 4096)
        mapping = hostmem.SharedMapping(fd, 3 * MIB + 4096)
        view = np.frombuffer(mapping.buffer(), dtype=np.uint8)
        assert mapping.address % hostmem.HUGE_ALIGN == 0 and view.ctypes.data == mapping.address
        view[-1] = 9
        with pytest.raises(ValueError):  # outside the mapping: refused before the kernel sees it
            mapping.madvise(hostmem.MADV_POPULATE_WRITE, 2 * MIB, 2 * MIB)
        del mapping
        gc.collect()
        assert view[-1] == 9  # the view holds the mapping
        assert os.pread(fd, 1, 3 * MIB + 4095) == b"\x09"  # shared: the file has the byte
        again = hostmem.SharedMapping(fd, 4096)
        again.close()
        with pytest.raises(ValueError, match="closed"):
            again.buffer()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_a_shared_file_on_a_disk_file_system_is_not_collapsed(tmp_path, monkeypatch, caplog):
    """MADV_COLLAPSE works on tmpfs (shmem) files only: a pool's ``shm_dir`` on a disk keeps 4 KiB pages, says so
    in one line, and is not asked (the kernel would refuse with EINVAL)."""
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n/dev/vdb {tmp_path} xfs rw 0 0\n")
    monkeypatch.setattr(hostmem, "MOUNTS", str(mounts))
    monkeypatch.setattr(hostmem, "THP_SHMEM", _setting(tmp_path, "shmem_enabled", "always advise [never] deny"))
    assert hostmem.collapsible("/dev/shm/kvtier") and not hostmem.collapsible(tmp_path / "pool")
    caplog.set_level(logging.INFO, "kvtier.memory.hostmem")
    buf = HostBuffer(2 * MIB, shm_path=tmp_path / "pool" / "dram")
    buf.tensor.fill_(3)
    assert buf.populated is None and int(buf.tensor.sum()) == 3 * 2 * MIB
    logs = _huge_logs(caplog)
    assert len(logs) == 1 and "is on xfs, not tmpfs" in logs[0], logs
