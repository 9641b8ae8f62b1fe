"""HostBuffer: one large host allocation, made once: plain, page-locked for fast GPU copies, or shared.

A shared buffer is a file (normally under /dev/shm) mapped MAP_SHARED, so another process (the node pool's
clients) can map the same bytes. Page-locking uses CUDA's host registration and is done only when CUDA is
present; on a CPU-only machine "auto" means plain memory.

Huge pages where the kernel gives them (``huge_pages``, on by default): a plain buffer is an anonymous private
mapping advised MADV_HUGEPAGE when transparent huge pages are ``always`` or ``madvise``; a shared file on tmpfs
is advised the same when the kernel's shmem setting (``shmem_enabled``) is ``advise`` (``always`` and
``within_size`` need no advice), and its pages are *collapsed* onto huge pages on a background thread
(madvise MADV_COLLAPSE, Linux 6.1) under every setting but ``deny``: the file's pages exist before any advice
(posix_fallocate makes them 4 KiB), and MADV_COLLAPSE gets huge pages even where the setting is ``never`` (this
project's machines: a two-process copy into the pool's file ran 5-12% faster on them). Shared files are mapped
at a 2 MiB-aligned address (``SharedMapping``): only there can one page-table entry map a huge page. A shared
file in a hugetlbfs mount (an operator's ``shm_dir``) is sized to whole huge pages. Anything else (THP
``never`` for private memory, ``deny``, a kernel before 6.1, a container without THP) keeps normal pages and
says so in one log line: never a failed start. ``pages()`` says which page size the buffer's memory is on, read
back from the kernel (/proc/self/smaps), not assumed from the advice.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MOUNTS = "/proc/self/mounts"
SMAPS = "/proc/self/smaps"
MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in, writable, without touching their bytes
MADV_COLLAPSE = 25  # Linux 6.1: move a range's pages onto transparent huge pages now, whatever the THP setting
HUGE_ALIGN = 2 << 20  # the x86-64 / arm64 (4 KiB granule) PMD size: a huge page maps only at this alignment
# The populate thread's nice value while it collapses: moving a page costs the kernel ~5 ms per 2 MiB here
# (2.7 s per GiB on one core), which must not take a core from the copies the buffer serves meanwhile.
COLLAPSE_NICE = 10
# Bytes per madvise(MADV_POPULATE_WRITE) call of a background populate: small enough that the owner dropping
# the mapping stops it soon (a step holds the mapping), large enough that the calls cost nothing.
POPULATE_STEP = 64 << 20
# The THP settings under which a mapping of that kind gets huge pages once advised (or without advice).
THP_PRIVATE_MODES = ("always", "madvise")
THP_SHMEM_MODES = ("always", "within_size", "advise", "force")
# The shmem settings under which MADV_COLLAPSE may move a file's pages onto huge pages (all but ``deny``, which
# refuses every huge page; "" is a kernel or container without the setting: tried, and a refusal is one log line).
THP_COLLAPSE_MODES = ("always", "within_size", "advise", "force", "never", "")
HUGETLBFS = "hugetlbfs"


class HostBuffer:
    """``nbytes`` of host memory as a 1-D uint8 tensor. Owned by its creator; freed on close()."""

    def __init__(self, nbytes: int, *, shm_path: str | os.PathLike[str] | None = None,
                 pin_memory: str | bool = "auto", prefault: bool = False, huge_pages: bool = True) -> None:
        if nbytes <= 0:
            raise ValueError(f"HostBuffer size must be > 0, got {nbytes}")
        self.nbytes = nbytes
        self.path = Path(shm_path) if shm_path else None
        self._registered = False
        # set when a shared buffer's background collapse onto huge pages and prefault are done (or gave up)
        self.populated: threading.Event | None = None
        want_pin = _want_pin(pin_memory)
        if self.path is not None:
            self.tensor, self.populated = _map_file(self.path, nbytes, huge_pages)
            if want_pin:
                self._registered = _cuda_host_register(self.tensor)
        elif want_pin:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.tensor = _private(nbytes, huge_pages)
        self.pinned = bool(want_pin and (self._registered or self.path is None))
        if prefault:
            self.tensor.zero_()  # fault every page in now rather than on the first puts
        self.ptr = int(self.tensor.data_ptr())

    def pages(self) -> str:
        """The page size the buffer's memory is on, as the kernel reports it: "4 KiB", "2 MiB (THP)" (with the
        share of the faulted-in bytes on huge pages where it is not all of them), "2 MiB (hugetlbfs)"; while a
        shared buffer is still being collapsed onto huge pages, followed by "; moving onto 2 MiB pages"."""
        moving = self.populated is not None and not self.populated.is_set()
        return page_sizes(self.ptr, self.nbytes) + ("; moving onto 2 MiB pages" if moving else "")

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self._registered = False
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def __repr__(self) -> str:
        where = f"shared at {self.path}" if self.path else ("pinned" if self.pinned else "private")
        return f"HostBuffer({self.nbytes} B, {where})"


def _want_pin(pin_memory: str | bool) -> bool:
    if isinstance(pin_memory, bool):
        wanted = pin_memory
    elif pin_memory in ("auto", "true", "false"):
        wanted = pin_memory == "true" or (pin_memory == "auto" and torch.cuda.is_available())
    else:
        raise ValueError(f"pin_memory must be auto, true or false, got {pin_memory!r}")
    if wanted and not torch.cuda.is_available():
        log.warning("pin_memory requested but CUDA is not available; using plain host memory")
        return False
    return wanted


def _private(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """``nbytes`` of anonymous private memory, advised onto transparent huge pages where the kernel allows."""
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages:
        mode = thp_mode(THP_ENABLED)
        if mode in THP_PRIVATE_MODES:
            _advise_huge(mem, nbytes, f"the DRAM buffer (transparent huge pages: {mode})")
        else:
            log.info("DRAM buffer on normal pages: transparent huge pages are %s (%s)", mode or "absent", THP_ENABLED)
    return torch.frombuffer(mem, dtype=torch.uint8)  # the tensor holds the mapping: unmapped with the last view


def _map_file(path: Path, nbytes: int, huge_pages: bool = True) -> tuple[torch.Tensor, threading.Event | None]:
    """Create (or reuse) ``path`` with exactly ``nbytes`` (whole huge pages in a hugetlbfs mount) and map it
    shared, advised onto huge pages where the kernel's shmem setting allows and collapsed onto them in the
    background where it does not deny them (the event: set when that is done)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    huge = hugetlbfs_page(path.parent) if huge_pages else 0
    size = whole_pages(nbytes, huge)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            try:  # reserve the pages now: a full /dev/shm must fail here, not with SIGBUS on a later put
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {size} bytes for the shared buffer {path}: "
                                       f"{e.strerror}") from None
        mapping = SharedMapping(fd, size, max(HUGE_ALIGN, huge))
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping.buffer(), dtype=torch.uint8)  # holds the mapping: unmapped with the last view
    populated = None
    if huge:
        log.info("shared buffer %s in a hugetlbfs mount: %d KiB pages", path, huge >> 10)
    elif huge_pages:
        mode = thp_mode(THP_SHMEM)
        if mode in THP_SHMEM_MODES:
            _advise_huge(mapping.address, size, f"the shared buffer {path} (shmem huge pages: {mode})")
        if collapsible(path.parent):
            populated = populate(mapping, lambda m: m, size, f"the shared buffer {path}", collapse=True)
        else:
            kind = mount_of(path.parent)[0]
            why = (f"the kernel's shmem huge pages are {mode} ({THP_SHMEM})" if kind == "tmpfs" else
                   f"{path.parent} is on {kind or 'an unknown file system'}, not tmpfs or hugetlbfs")
            log.info("shared buffer %s on normal pages: %s", path, why)
    return tensor[:nbytes], populated


class Advisable(Protocol):
    """A mapping ``populate`` can advise: an ``mmap.mmap`` or a ``SharedMapping``."""

    def madvise(self, option: int, start: int = 0, length: int = ...) -> None: ...


def populate(owner: object, mm: Callable[[Any], Advisable], nbytes: int, what: str, *,
             collapse: bool = False) -> threading.Event:
    """Fault the first ``nbytes`` of a shared mapping into this process's page tables, writable, on a daemon
    thread (madvise MADV_POPULATE_WRITE, POPULATE_STEP at a time); the event is set when it is done or gave up.
    With ``collapse`` each step is first moved onto huge pages (MADV_COLLAPSE; the mapping must start on a
    HUGE_ALIGN boundary: a ``SharedMapping``), the thread at nice COLLAPSE_NICE: a kernel that refuses (before
    6.1, THP off in the container) stops the collapsing after one log line, the populating goes on; a step the
    kernel could not collapse now (EAGAIN/EBUSY: pages in use, no free huge page) stays on normal pages.

    Why: another process's file mapped here (the node pool's DRAM) starts with no page-table entries, and every
    4 KiB page first touched by a copy costs a minor fault: copies into a pool a client had not touched yet ran at
    ~2.4 GB/s where warm ones ran at 17-22 (two processes, 4 MiB blocks, this project's 2-core machines). The
    pages themselves are the file's (its owner allocated them); this adds only page tables (8 bytes per page,
    0.2 % of the mapping) and touches no byte. ``owner`` is held weakly and ``mm(owner)`` gives the mapping for
    each step: the owner dropping the mapping stops the thread at its next step. A kernel without the advice
    (before 5.14) keeps faulting pages on first use, after one log line."""
    done = threading.Event()
    ref = weakref.ref(owner)

    def run() -> None:
        squeeze = collapse
        if squeeze:
            try:  # per thread on Linux: the kernel's work in madvise runs at this thread's priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COLLAPSE_NICE)
            except (OSError, AttributeError):
                pass
        try:
            for start in range(0, nbytes, POPULATE_STEP):
                obj = ref()
                if obj is None:
                    return
                step = min(POPULATE_STEP, nbytes - start)
                if squeeze:
                    squeeze = _collapse(mm(obj), start, step, what)
                try:
                    mm(obj).madvise(MADV_POPULATE_WRITE, start, step)
                except (OSError, ValueError) as e:  # ValueError: the mapping was closed meanwhile
                    log.info("%s: pages not prefaulted (madvise(MADV_POPULATE_WRITE): %s); they fault in at first "
                             "use", what, e)
                    return
                finally:
                    del obj
        finally:
            done.set()

    threading.Thread(target=run, name="kvtier-populate", daemon=True).start()
    return done


def _collapse(mapping: Advisable, start: int, length: int, what: str) -> bool:
    """MADV_COLLAPSE on one step of a mapping; False when the kernel refuses it for good (stop asking)."""
    try:
        mapping.madvise(MADV_COLLAPSE, start, length)
    except ValueError:  # closed meanwhile: the populate that follows says so
        return False
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EBUSY, errno.ENOMEM):  # this step, now: the next may collapse
            log.debug("%s: bytes %d-%d stay on normal pages (madvise(MADV_COLLAPSE): %s)", what, start,
                      start + length, e.strerror)
            return True
        log.info("%s on normal pages: madvise(MADV_COLLAPSE) refused (%s; it needs Linux 6.1 and transparent "
                 "huge pages in the kernel)", what, e.strerror or e)
        return False
    return True


class SharedMapping:
    """A file's first ``length`` bytes mapped MAP_SHARED, read-write, at a HUGE_ALIGN-aligned address.

    Why not ``mmap.mmap``: it takes no address, and a huge page of the file maps with one page-table entry only
    where the address is congruent to the file offset modulo its size; elsewhere MADV_COLLAPSE is refused
    (EINVAL) and the copies pay a TLB entry per 4 KiB. Made by reserving ``length`` + HUGE_ALIGN of address space
    and mapping the file over its aligned part (MAP_FIXED), then giving the slack back; ``align`` is larger for a
    file in a hugetlbfs mount of larger pages (its mappings must start on one). ``buffer()`` is a
    ctypes array over the bytes that keeps the mapping alive; unmapped when the mapping and every buffer are
    gone (or at ``close``, which the caller makes only when no view is left)."""

    def __init__(self, fd: int, length: int, align: int = HUGE_ALIGN) -> None:
        if length <= 0:
            raise ValueError(f"SharedMapping length must be > 0, got {length}")
        self.length = length
        span = length + align
        reserved = _libc_mmap(None, span, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        aligned = -(-reserved // align) * align
        try:
            got = _libc_mmap(aligned, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd)
        except OSError:
            _munmap(reserved, span)
            raise
        end = aligned + -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
        if aligned > reserved:
            _munmap(reserved, aligned - reserved)
        if reserved + span > end:
            _munmap(end, reserved + span - end)
        self.address = got
        self._unmap = weakref.finalize(self, _munmap, got, end - got)

    def buffer(self) -> ctypes.Array[ctypes.c_uint8]:
        """The mapped bytes, as a buffer (for numpy / torch) that holds this mapping."""
        if not self._unmap.alive:
            raise ValueError("the shared mapping is closed")
        array = (ctypes.c_uint8 * self.length).from_address(self.address)
        array._mapping = self  # type: ignore[attr-defined]  # the view's lifetime holds the mapping's
        return array

    def madvise(self, option: int, start: int = 0, length: int | None = None) -> None:
        """madvise on [start, start + length) (to the end by default); OSError as the kernel answers."""
        if not self._unmap.alive:
            raise ValueError("the shared mapping is closed")
        length = self.length - start if length is None else length
        if start < 0 or start % mmap.PAGESIZE or length < 0 or start + length > self.length:
            raise ValueError(f"madvise range {start}+{length} outside the {self.length} B mapping or unaligned")
        if _LIBC.madvise(ctypes.c_void_p(self.address + start), ctypes.c_size_t(length), option) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def close(self) -> None:
        self._unmap()


PROT_NONE = 0
MAP_FIXED = 0x10  # <asm-generic/mman-common.h>; the mmap module does not export it
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc_mmap(address: int | None, length: int, prot: int, flags: int, fd: int) -> int:
    got = _LIBC.mmap(address, length, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    return int(got)


def _munmap(address: int, length: int) -> None:
    _LIBC.munmap(address, length)


def whole_pages(nbytes: int, page: int) -> int:
    """``nbytes`` rounded up to whole pages of ``page`` bytes (a hugetlbfs mount's: its files and mappings must
    be; ``hugetlbfs_page`` answers which); ``nbytes`` where ``page`` is 0 (any other file system)."""
    return -(-nbytes // page) * page if page else nbytes


def thp_mode(setting: str) -> str:
    """The selected word of a transparent-huge-page setting (``always [madvise] never`` -> "madvise"); "" where the
    file is missing or unreadable (no THP in this kernel or container)."""
    try:
        text = Path(setting).read_text()
    except OSError:
        return ""
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else ""


def mount_of(directory: str | os.PathLike[str], mounts: str | None = None) -> tuple[str, str, str]:
    """(file system type, mount options, mount point) of the mount ``directory`` is in, by the longest mount
    point that holds it; ("", "", "") where the mount table cannot be read (a container without
    /proc/self/mounts)."""
    try:
        where = os.path.realpath(directory)
        table = Path(mounts or MOUNTS).read_text().splitlines()
    except OSError:
        return "", "", ""
    best, kind, options = "", "", ""
    for line in table:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (where == point or where.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind, options = point, fields[2], fields[3]
    return kind, options, best


def hugetlbfs_page(directory: Path, mounts: str | None = None) -> int:
    """The huge page size of the hugetlbfs mount ``directory`` is in; 0 when it is on another filesystem (or
    does not exist: the caller creates it, on whatever is mounted there)."""
    kind, options, point = mount_of(directory, mounts)
    if kind != HUGETLBFS:
        return 0
    m = re.search(r"pagesize=(\d+)([KMG]?)", options)
    if m:
        return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    try:
        return os.statvfs(point).f_bsize
    except OSError:
        return 0


def collapsible(directory: str | os.PathLike[str], mounts: str | None = None) -> bool:
    """Whether a shared file in ``directory`` may be collapsed onto transparent huge pages (MADV_COLLAPSE): it is
    on tmpfs (shmem; a file on a disk file system is refused, EINVAL) and the kernel's shmem setting does not
    deny huge pages. An unreadable mount table is tried (a refusal is one log line)."""
    kind = mount_of(directory, mounts)[0]
    return kind in ("tmpfs", "") and thp_mode(THP_SHMEM) in THP_COLLAPSE_MODES


def _advise_huge(where: mmap.mmap | int, nbytes: int, what: str) -> None:
    """madvise(MADV_HUGEPAGE) on a mapping (an mmap object, or the address of a page-aligned one); a refusal is
    one log line, the buffer stays on normal pages."""
    try:
        if isinstance(where, mmap.mmap):
            where.madvise(MADV_HUGEPAGE)
        else:
            if _LIBC.madvise(ctypes.c_void_p(where), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
    except (OSError, ValueError, AttributeError) as e:
        log.info("%s on normal pages: madvise(MADV_HUGEPAGE) refused (%s)", what, e)


def page_sizes(ptr: int, nbytes: int, smaps: str | None = None) -> str:
    """The page size of the memory at [ptr, ptr + nbytes) as this process's smaps reports it."""
    try:
        text = Path(smaps or SMAPS).read_text()
    except OSError:
        return "unknown"
    kernel, rss, huge, advised = 0, 0, 0, False
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        span = entry.split(None, 1)[0].split("-")
        start, end = int(span[0], 16), int(span[1], 16)
        if end <= ptr or start >= ptr + nbytes:
            continue
        fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", entry, re.M))
        kernel = max(kernel, int(fields.get("KernelPageSize", 4)))
        flags = re.search(r"^VmFlags:(.*)$", entry, re.M)
        advised |= bool(flags) and "hg" in flags.group(1).split()
        rss += int(fields.get("Rss", 0))
        huge += int(fields.get("AnonHugePages", 0)) + int(fields.get("ShmemPmdMapped", 0)) + \
            int(fields.get("FilePmdMapped", 0))
    if kernel > 4:
        return f"{_kib(kernel)} (hugetlbfs)"
    if huge and rss:
        share = "" if huge >= rss else f", {100 * huge // rss}% of {_kib(rss)} resident"
        return f"2 MiB (THP{share})"
    if advised and not rss:  # huge pages asked for, no page faulted in yet (a buffer not prefaulted)
        return "2 MiB (THP advised, none resident yet)"
    return "4 KiB"


def _kib(k: int) -> str:
    return f"{k >> 20} GiB" if k >= 1 << 20 and not k % (1 << 20) else \
        (f"{k >> 10} MiB" if k >= 1 << 10 and not k % (1 << 10) else f"{k} KiB")


def _cuda_host_register(t: torch.Tensor) -> bool:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister of the shared DRAM buffer failed (%s); GPU copies will be slower", rc)
        return False
    return True
