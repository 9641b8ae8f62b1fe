"""MasterDisk: the master's state in lmdb (``DATA_DIR/master.lmdb``): node registry, hints, directory snapshot.

What persists and why:

* node records (id, address, tiers, labels, incarnation): written when a node registers, so a restarted
  master knows its nodes and their location numbering;
* hints: written when they change (debounced by the caller), since routers set them once and expect them to
  outlive a master restart;
* a directory snapshot (every live entry's columns, the heat clock, and per node the incarnation, event
  sequence number and locations the snapshot is consistent with), written on clean shutdown and every
  ``--snapshot-interval-s``. After a crash the snapshot may be stale; nodes whose sequence number moved on
  are asked for a full inventory at their first heartbeat (the registry's ``pending`` state), so stale data is
  never answered from. Heat lives only here: nodes cannot resend it.

Every write is one lmdb transaction (a snapshot replaces the previous one atomically). Sync methods; the
master calls them from one writer thread so that a large snapshot never blocks its event loop, and
never concurrently (lmdb allows one writer).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np

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
            self.path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4, subdir=True, sync=True,
                                 metasync=True, lock=True)
        except (OSError, lmdb.Error) as e:
            raise DiskError(f"cannot open the master's lmdb at {self.path}: {e}") from None
        self._nodes = self.env.open_db(b"nodes")
        self._meta = self.env.open_db(b"meta")
        self._snap = self.env.open_db(b"snapshot")

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
        self._write(lambda txn: txn.put(record["node"].encode(), _pack(record), db=self._nodes))

    def load_nodes(self) -> list[dict[str, Any]]:
        with self.env.begin() as txn:
            return [_unpack(v) for _, v in txn.cursor(db=self._nodes)]

    def save_hints(self, hints: dict[str, Any]) -> None:
        self._write(lambda txn: txn.put(b"hints", _pack(hints), db=self._meta))

    def load_hints(self) -> dict[str, Any] | None:
        with self.env.begin() as txn:
            raw = txn.get(b"hints", db=self._meta)
        return _unpack(raw) if raw is not None else None

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
