"""MasterDisk: the master's state in lmdb (``DATA_DIR/master.lmdb``): node registry, hints, directory snapshot.

What persists and why:

* node records (id, address, tiers, labels, incarnation): written when a node registers, so a restarted
  master knows its nodes and their location numbering;
* hints: one record per entry, written when it changes (the caller batches a tick's changes into one
  transaction), since routers set them once and expect them to outlive a master restart; a change writes its
  own records, never the whole table;
* node records are rewritten when a node registers or dies (a dead node's record says when, so a restart
  forgets it after the grace period instead of bringing it back) and deleted when the master forgets it;
* a directory snapshot (every live entry's columns, the heat clock, and per node the incarnation, event
  sequence number and locations the snapshot is consistent with), written on clean shutdown and every
  ``--snapshot-interval-s``. After a crash the snapshot may be stale; nodes whose sequence number moved on
  are asked for a full inventory at their first heartbeat (the registry's ``pending`` state), so stale data is
  never answered from. Heat lives only here: nodes cannot resend it.

Every write is one lmdb transaction (a snapshot replaces the previous one atomically). The directory is made
0700 and lmdb's files 0600: directory contents and hints say what users' prompts are. Sync methods; the
master calls them from one writer thread so that a large snapshot never blocks its event loop, and
never concurrently (lmdb allows one writer).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np

from kvtier.master.hints import HintChange, HintTable, from_wire_time, wire_time
from kvtier.private import private_dir, private_files

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
FORMAT = 1


class DiskError(RuntimeError):
    """The data directory cannot be opened or written (the message says which path and why)."""


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class MasterDisk:
    """One lmdb environment; ``map_size`` grows by doubling when a write does not fit."""

    def __init__(self, data_dir: str | os.PathLike[str], map_size: int = 1 << 30) -> None:
        self.path = Path(data_dir) / "master.lmdb"
        try:
            private_dir(Path(data_dir))
            private_dir(self.path)
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=5, subdir=True, sync=True,
                                 metasync=True, lock=True, mode=0o600)
            private_files(self.path)
        except (OSError, lmdb.Error) as e:
            raise DiskError(f"cannot open the master's lmdb at {self.path}: {e}") from None
        self._nodes = self.env.open_db(b"nodes")
        self._meta = self.env.open_db(b"meta")
        self._snap = self.env.open_db(b"snapshot")
        self._hints = self.env.open_db(b"hints")

    def _write(self, fn: Any) -> None:
        """Run ``fn(txn)`` in one write transaction, growing the map once per MapFullError."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                new = self.env.info()["map_size"] * 2
                log.info("master lmdb map full: growing it to %d MiB", new >> 20)
                self.env.set_mapsize(new)

    # ---- nodes and hints -------------------------------------------------------------------------------

    def save_node(self, record: dict[str, Any]) -> None:
        self._write(lambda txn: txn.put(_node_key(record["node"]), _pack(record), db=self._nodes))

    def load_nodes(self) -> list[dict[str, Any]]:
        with self.env.begin() as txn:
            return [_unpack(v) for _, v in txn.cursor(db=self._nodes)]

    def delete_node(self, node_id: str) -> None:
        self._write(lambda txn: txn.delete(_node_key(node_id), db=self._nodes))

    def save_hints(self, changes: list[HintChange], version: int) -> int:
        """Write the entries that changed (a removed one is deleted) and the table's version in one transaction;
        returns the bytes of the records written."""
        records = [(_hint_key(c), None if c.value is None else _pack(_hint_value(c))) for c in changes]

        def write(txn: lmdb.Transaction) -> None:
            for key, value in records:
                if value is None:
                    txn.delete(key, db=self._hints)
                else:
                    txn.put(key, value, db=self._hints)
            txn.put(b"hints_version", _pack(version), db=self._meta)
            txn.delete(b"hints", db=self._meta)  # the whole-table blob of format 1, once migrated

        self._write(write)
        return sum(len(k) + len(v or b"") for k, v in records)

    def load_hints(self) -> tuple[list[HintChange], int] | None:
        """(entries, version), or None if no hint was ever saved. A data dir written by an older master (one
        blob for the whole table) is read too; its next save moves it to records."""
        with self.env.begin() as txn:
            raw_version = txn.get(b"hints_version", db=self._meta)
            if raw_version is not None:
                return [_hint_entry(_unpack(v)) for _, v in txn.cursor(db=self._hints)], int(_unpack(raw_version))
            blob = txn.get(b"hints", db=self._meta)
        if blob is None:
            return None
        old = HintTable.from_wire(_unpack(blob), max_keys=1 << 62, max_sessions=1 << 62)
        return list(old.entries()), old.version

    # ---- directory snapshot ----------------------------------------------------------------------------

    def save_snapshot(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> int:
        """Replace the snapshot; returns the bytes written."""
        manifest: dict[str, Any] = {"format": FORMAT, "meta": meta, "arrays": {}}
        total = 0

        def write(txn: lmdb.Transaction) -> None:
            nonlocal total
            txn.drop(self._snap, delete=False)
            for name, arr in arrays.items():
                raw = np.ascontiguousarray(arr).tobytes()
                chunks = max(1, -(-len(raw) // CHUNK_BYTES))
                for i in range(chunks):
                    txn.put(f"{name}/{i}".encode(), raw[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES], db=self._snap)
                manifest["arrays"][name] = [arr.dtype.str, list(arr.shape), chunks]
                total += len(raw)
            txn.put(b"manifest", _pack(manifest), db=self._snap)

        self._write(write)
        return total

    def load_snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, meta) of the last snapshot, or None. A snapshot of an unknown format is ignored (logged)."""
        with self.env.begin(buffers=False) as txn:
            raw = txn.get(b"manifest", db=self._snap)
            if raw is None:
                return None
            manifest = _unpack(raw)
            if manifest.get("format") != FORMAT:
                log.warning("ignoring a directory snapshot of format %r (this master reads %d); nodes resync",
                            manifest.get("format"), FORMAT)
                return None
            arrays = {}
            for name, (dtype, shape, chunks) in manifest["arrays"].items():
                parts = [txn.get(f"{name}/{i}".encode(), db=self._snap) for i in range(chunks)]
                if any(p is None for p in parts):
                    log.warning("directory snapshot is missing chunks of %r; ignoring it (nodes resync)", name)
                    return None
                # Read-only views of one joined buffer: Directory.restore copies into its own columns.
                arrays[name] = np.frombuffer(b"".join(parts), dtype=np.dtype(dtype)).reshape(shape)
        return arrays, manifest["meta"]

    def close(self) -> None:
        self.env.close()


def _node_key(node_id: str) -> bytes:
    """A node id as an lmdb key (at most 511 bytes: a long UTF-8 id goes by its digest)."""
    raw = node_id.encode()
    return raw if len(raw) <= 400 else b"\x00" + hashlib.blake2b(raw, digest_size=32).digest()


# ---- hint records: key = table byte + the 16-byte key, or a digest of the session name (lmdb keys are short) ----

def _hint_key(c: HintChange) -> bytes:
    name = c.name if isinstance(c.name, bytes) else hashlib.blake2b(c.name.encode(), digest_size=16).digest()
    return bytes([c.which]) + name


def _hint_value(c: HintChange) -> list[Any]:
    level, until = c.value if isinstance(c.value, tuple) else (None, c.value)
    return [c.which, c.name, wire_time(until), level, c.owner]


def _hint_entry(v: list[Any]) -> HintChange:
    which, name, until, level, owner = v
    t = from_wire_time(until)
    return HintChange(which, name, t if level is None else (level, t), owner)
