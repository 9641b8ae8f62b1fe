"""ShmConnection: standalone mode. The pool's DRAM is a file this process maps once; a get is one copy.

Engine processes on one host share one pool: control goes over zmq ipc, bytes never touch a socket. The
lease protocol (reserve/commit, acquire/release) is OneSidedConnection's; the copies here are the caller's own
batched native copies (kvtier.memory.hostcopy), straight between the caller's rows and the pool's slots, on
``copy_threads`` threads (0, the default: by measured rate: hostcopy.CopyThreads times this connection's puts
and its gets apart and gives each batch the thread count that copied fastest here lately).

Pool restarts: every reply carries the pool's epoch. A new epoch means a new pool with a new file; the next
call says hello again and maps the new file. The old mapping stays valid (the file is unlinked, not
truncated) until the calls still copying from it finish and drop it; blocks of the old pool are gone. A pool
that has no block size yet has no file either: the connection maps it at its first copy (after the reserve
that sized the pool).

The mapping is prefaulted on a background thread as it is made (kvtier.memory.hostmem.populate: page tables only, no
byte touched): a copy into pages this process had not touched yet ran ~8x slower, one minor fault per 4 KiB.
It starts on a 2 MiB boundary and is collapsed onto the file's huge pages (kvtier.memory.hostmem.SharedMapping): the
pool moves its file onto them, and this side then maps each with one entry.

Next to the DRAM file each mapping holds the pool's slot generations (``<file>.gen``, read-only): a get reads
its slots' generations there after its copy (kvtier/wire/generations.py).

Only the pool's own memory is mapped: the DRAM and generation files must be regular files owned by the uid
the kernel reports for the pool's end of the ipc socket (kvtier/auth/peercred.py). A process squatting on a
pool's socket path can make a client map only files it could read and write itself; a file it names that it
does not own (another user's secret, a file of the client's own) is refused (PoolProtocolError), never
opened for a copy.

Thread-safe; offsets from the pool are bounds-checked against the mapping before any copy.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth.peercred import NotPeersFile, open_peers_file
from kvtier.memory.hostcopy import CopyThreads
from kvtier.memory.hostmem import (HUGE_ALIGN, SharedMapping, collapsible, hugetlbfs_page, page_sizes, populate,
                            whole_pages)
from kvtier.transport.base import PoolInfo, PoolProtocolError, PoolUnavailable
from kvtier.transport.connection import hello
from kvtier.transport.onesided import OneSidedConnection
from kvtier.wire.generations import GenerationView

log = logging.getLogger(__name__)


class Mapping:
    """The pool's DRAM file of one epoch, mapped shared into this process, and its slot generations; unmapped
    when the last user drops it. Both files must be regular files owned by ``uid``, the pool process's uid the
    kernel reported for the ipc connection (kvtier/auth/peercred.py): a pool, or anything squatting on its
    socket, can make this process map only files it owns itself (NotPeersFile otherwise)."""

    def __init__(self, path: str, nbytes: int, epoch: int, generations: str, block_bytes: int,
                 uid: int | None, pid: int | None = None) -> None:
        self.path, self.nbytes, self.epoch = path, nbytes, epoch
        self._process = _watch(self, pid)
        # A select.poll object refuses a second poll() while one runs ("concurrent poll() invocation"): the
        # connection's calls ask ``serving`` from many threads at once.
        self._process_lock = threading.Lock()
        fd = open_peers_file(path, os.O_RDWR, uid, "the pool's shared file")
        try:
            st = os.fstat(fd)
            self._inode = (st.st_dev, st.st_ino)
            size = st.st_size
            if size < nbytes:
                raise PoolProtocolError(f"ipc ({path})", f"the pool's shared file is {size} bytes, it said "
                                        f"{nbytes}", wire.ERR_BAD_MESSAGE)
            # whole huge pages where the pool made its file in a hugetlbfs mount, at an address where its huge
            # pages map with one page-table entry each (kvtier.memory.hostmem)
            huge = hugetlbfs_page(Path(path).parent)
            self._mm = SharedMapping(fd, whole_pages(nbytes, huge), max(HUGE_ALIGN, huge))
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._mm.buffer(), dtype=np.uint8)[:nbytes]
        self.base = int(self._array.ctypes.data)
        # the pool collapses its file onto huge pages too; here it maps them (or does the pool's share of it)
        self.populated = populate(self, lambda m: m._mm, nbytes, f"the pool's shared file {path}",
                                  collapse=not huge and collapsible(Path(path).parent))
        self.block_bytes = block_bytes
        fd = open_peers_file(generations, os.O_RDONLY, uid, "the pool's generation file")
        try:
            self.generations = GenerationView(fd, generations, nbytes // block_bytes)
        finally:
            os.close(fd)

    @property
    def watched(self) -> bool:
        return self._process is not None

    def serving(self) -> bool:
        """Whether the file mapped is still a live pool's: the pool process has not exited (a pidfd polled:
        a killed pool leaves its file behind) and the file is still the one at its path (a restarted pool
        removes its predecessor's, and a mapping outlives that). A few microseconds; False when the pool's
        process cannot be watched (another pid namespace)."""
        if self._process is None:
            return False
        with self._process_lock:
            if self._process.poll(0):
                return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def generations_at(self, offsets: np.ndarray) -> np.ndarray:
        return self.generations.of(offsets.astype(np.int64) // self.block_bytes)

    def rows(self, offsets: np.ndarray, block_bytes: int) -> np.ndarray:
        """Addresses of blocks at ``offsets``; PoolProtocolError if one would fall outside the file."""
        if len(offsets) and (int(offsets.min()) < 0 or int(offsets.max()) + block_bytes > self.nbytes):
            raise PoolProtocolError(f"ipc ({self.path})", "the pool named an offset outside its shared file",
                                    wire.ERR_BAD_MESSAGE)
        return np.uint64(self.base) + offsets.astype(np.uint64)


def _watch(owner: object, pid: int | None) -> select.poll | None:
    """A poll of a pidfd of the pool's process (readable once it exits), closed with ``owner``; None where there
    is no pid to watch or the kernel has no pidfds."""
    if not pid:
        return None
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    weakref.finalize(owner, os.close, fd)
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return poll


class ShmConnection(OneSidedConnection):
    """Blocks through the pool's shared-memory file. See ConnectionBase and PoolConnection."""

    transport = "shm"

    def __init__(self, channel: Any, info: PoolInfo, *, copy_threads: int = 0, **kw: Any) -> None:
        super().__init__(channel, info, **kw)
        if copy_threads < 0:
            raise ValueError(f"copy_threads must be >= 0 (0: by measured rate), got {copy_threads}")
        self.copy_threads = copy_threads
        # Puts and gets apart: a get reads the shared file and writes the caller's rows, a put the other way, and
        # the two need not gain alike from a second thread.
        self.put_copies, self.get_copies = CopyThreads(copy_threads), CopyThreads(copy_threads)
        self._lock = threading.Lock()
        self._mapping: Mapping | None = self._map(info) if info.sized else None

    # The mapping is held in a local for the whole copy: a concurrent call that re-maps after a restart drops
    # the connection's reference, and the last reference gone unmaps the file (a copy into it would fault).
    def _write(self, offsets: np.ndarray, src: np.ndarray, epoch: int) -> None:
        mapping = self._mapped(epoch)
        self.put_copies.copy(mapping.rows(offsets, self.block_bytes), src, self.block_bytes)
        del mapping

    def _read(self, dst: np.ndarray, offsets: np.ndarray, epoch: int) -> None:
        mapping = self._mapped(epoch)
        self.get_copies.copy(dst, mapping.rows(offsets, self.block_bytes), self.block_bytes)
        del mapping

    def pages(self) -> str:
        """The page size of the pool's shared file as mapped here (kvtier.memory.hostmem.page_sizes); "" before it is
        mapped."""
        mapping = self._mapping
        return page_sizes(mapping.base, mapping.nbytes) if mapping is not None else ""

    def _generations(self, offsets: np.ndarray, epoch: int) -> np.ndarray:
        return self._mapped(epoch).generations_at(offsets)

    def _still_serving(self, epoch: int) -> bool:
        mapping = self._mapping
        return mapping is not None and mapping.epoch == epoch and mapping.serving()

    # ---- mapping ---------------------------------------------------------------------------------------

    def _map(self, info: PoolInfo) -> Mapping:
        shm = info.transports.get("shm") or {}
        if not shm.get("path"):
            raise PoolProtocolError(self.endpoint, "the pool named no shared file", wire.ERR_BAD_MESSAGE)
        try:
            mapping = Mapping(str(shm["path"]), int(shm["nbytes"]), info.epoch, str(shm.get("generations") or ""),
                              info.block_bytes, info.uid, info.pid)
        except NotPeersFile as e:  # not the pool's own memory: never mapped, whatever else the pool offers
            log.warning("pool %s: refused to map the file it named: %s", self.endpoint, e)
            raise PoolProtocolError(self.endpoint, f"refused to map the file the pool named: {e}",
                                    wire.ERR_BAD_MESSAGE) from None
        except (OSError, ValueError) as e:
            raise PoolUnavailable(self.endpoint, f"cannot map the pool's shared file {shm['path']}: "
                                                 f"{e.strerror if isinstance(e, OSError) else e} "
                                                 "(is the pool on another host, or in another container?)",
                                  "no_shm") from None
        log.info("pool %s: mapped its DRAM %s (%d B, epoch %x)%s", self.endpoint, mapping.path, mapping.nbytes,
                 info.epoch, "" if mapping.watched else "; its process cannot be watched from here (pid %s): every "
                 "get asks the pool, none reads where a block was last seen" % info.pid)
        return mapping

    def _mapped(self, epoch: int, timeout_s: float | None = None) -> Mapping:
        """The mapping of ``epoch`` (mapping the file of a pool sized since the hello, re-mapping after a pool
        restart); PoolUnavailable if the pool moved on."""
        mapping = self._mapping
        if mapping is not None and mapping.epoch == epoch:
            return mapping
        with self._lock:
            if self._mapping is None or self._mapping.epoch != epoch:
                info = hello(self.channel, self.block_bytes, timeout_s, self.session)
                if info.epoch != epoch:
                    raise PoolUnavailable(self.endpoint, "the pool restarted again during the call", "restarted")
                if not info.sized:
                    raise PoolUnavailable(self.endpoint, "the pool has no shared file yet", "not_ready")
                self._mapping = self._map(info)
                self._adopt(info)
            return self._mapping

    def _hello_again(self, deadline: float | None) -> None:
        info = hello(self.channel, self.block_bytes, self._time_left(deadline), self.session)
        self._adopt(info)
        if info.sized:
            self._mapped(info.epoch, self._time_left(deadline))

