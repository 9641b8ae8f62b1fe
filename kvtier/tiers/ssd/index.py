"""The SSD tier's durable index, in lmdb: block key -> where its bytes are and how to check them.

Two databases in ``<ssd_path>/index``: ``blocks`` maps a 16-byte key to an ``IndexEntry`` (segment, offset,
length, checksum, layout fingerprint, write sequence); ``meta`` holds the directory's geometry (slot size,
slots per segment, ...) so a reopen with other settings starts clean instead of misreading old files.

Crash ordering (the tier relies on it): an entry is committed only after its bytes are on stable storage, and
an entry is deleted (committed) before its slot is overwritten. Every ``write`` is one transaction, durable
when it returns if ``sync`` (lmdb's own fsync); with ``sync`` off a process crash loses nothing but a machine
crash may lose the last transactions - the checksums still keep wrong bytes out.
"""

from __future__ import annotations

import errno
import json
import logging
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import xxhash

from kvtier.private import private_dir, private_files

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_ENTRY = struct.Struct("<IQIQQQ")  # segment, offset, length, checksum, fingerprint, seq: 40 bytes
_GEOMETRY = b"geometry"


@dataclass(frozen=True)
class IndexEntry:
    """Where one block lives: ``length`` bytes at ``offset`` of segment ``segment``; ``checksum`` is xxh3-64 of
    those bytes seeded with the key; ``fingerprint`` names the layout (and block size) it was written for;
    ``seq`` orders writes (eviction order survives a restart)."""

    segment: int
    offset: int
    length: int
    checksum: int
    fingerprint: int
    seq: int

    def pack(self) -> bytes:
        return _ENTRY.pack(self.segment, self.offset, self.length, self.checksum, self.fingerprint, self.seq)

    @classmethod
    def unpack(cls, raw: bytes) -> IndexEntry | None:
        """None when ``raw`` is not an entry of this format (a row from another version: treated as a miss)."""
        return cls(*_ENTRY.unpack(raw)) if len(raw) == _ENTRY.size else None


class IndexFault(OSError):
    """An lmdb failure (disk full, I/O error) opening or changing the index; ``errno`` says which."""


class DiskIndex:
    """One lmdb environment. Thread-safe: writes are serialized (lmdb allows one writer), reads run at open.

    Opened by one process at a time (the tier holds a lock file around it)."""

    def __init__(self, path: Path, *, sync: bool, map_size: int) -> None:
        private_dir(path)  # the index names every block held: its owner's only (kvtier/private.py)
        self.path = path
        self._map_size = map_size
        self._write_lock = threading.Lock()
        try:
            self._env = lmdb.open(str(path), subdir=True, map_size=map_size, max_dbs=2, sync=sync,
                                  metasync=sync, readahead=False, meminit=False, mode=0o600)
        except lmdb.Error as e:
            raise _os_error(e, f"opening the SSD index at {path}") from None
        private_files(path)
        self._env.reader_check()  # forget reader slots of processes that died (kill -9)
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")

    def geometry(self) -> dict[str, Any] | None:
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(_GEOMETRY)
        return json.loads(raw) if raw else None

    def reset(self, geometry: dict[str, Any]) -> None:
        """Forget every entry and record ``geometry`` (a fresh directory, or one written with other settings)."""
        with self._write_lock:
            self._txn(lambda txn: (txn.drop(self._blocks, delete=False),
                                   txn.put(_GEOMETRY, json.dumps(geometry, sort_keys=True).encode(),
                                           db=self._meta)))

    def items(self) -> Iterator[tuple[bytes, IndexEntry | None]]:
        """Every (key, entry); entry None for a row this version cannot read."""
        with self._env.begin(db=self._blocks) as txn:
            for key, raw in txn.cursor():
                yield bytes(key), IndexEntry.unpack(bytes(raw))

    def write(self, put: Sequence[tuple[bytes, IndexEntry]] = (), delete: Sequence[bytes] = ()) -> None:
        """Delete then put, in one transaction (durable on return when ``sync``). Raises IndexFault."""
        if not put and not delete:
            return

        def apply(txn: lmdb.Transaction) -> None:
            for k in delete:
                txn.delete(k, db=self._blocks)
            if put:
                cursor = txn.cursor(db=self._blocks)
                cursor.putmulti([(k, e.pack()) for k, e in put])

        with self._write_lock:
            self._txn(apply)

    def __len__(self) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(self._blocks)["entries"])

    def close(self) -> None:
        self._env.close()

    def _txn(self, apply: Any) -> None:
        """Run ``apply`` in a write transaction, growing the map once if it is full. Caller holds the lock."""
        for attempt in (0, 1):
            try:
                with self._env.begin(write=True) as txn:
                    apply(txn)
                return
            except lmdb.MapFullError:
                if attempt:
                    raise IndexFault(errno.ENOSPC, f"the SSD index at {self.path} is full at "
                                                    f"{self._map_size} bytes") from None
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)
                log.info("SSD index at %s grown to %d bytes", self.path, self._map_size)
            except lmdb.Error as e:
                raise _os_error(e, f"updating the SSD index at {self.path}") from None


def _os_error(e: lmdb.Error, what: str) -> IndexFault:
    text = str(e)
    code = errno.ENOSPC if "No space" in text else errno.EIO
    return IndexFault(code, f"{what}: {text}")


def block_checksum(data: memoryview, key: bytes) -> int:
    """xxh3-64 of a block's bytes seeded with its key: a block read from the wrong slot (a stale entry, a
    misdirected write) fails like a corrupted one."""
    return xxhash.xxh3_64_intdigest(data, int.from_bytes(key[:8], "little"))
