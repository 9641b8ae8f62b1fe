"""KeyTable: an open-addressing hash table of 16-byte keys held in numpy columns, with batch operations only.

Why not a dict: a Python dict of 10M ``bytes`` keys costs ~150 B per key before any value is attached, and
every lookup of a 2,000-key prompt would be 2,000 interpreter round trips. Here a key is two uint64 words
(columns ``k0``, ``k1``), a slot's state is one byte, and every operation takes a whole batch. Probing is
linear; the probe loops run in native code (native/cpu/keytable.c, one pass per batch) when kvtier's native
CPU library is built, else as vectorized numpy rounds (one pass per probe round). Both give the same answers.

The table also owns the per-slot *columns* of its users (placement masks, heat, ...): a rehash moves every
column with its key, so a slot index is a stable handle until the next call that may rehash (insert,
reserve, delete); ``generation`` counts rehashes.

Not thread-safe: its owner serializes every call (the master's event loop; the DRAM tier's lock, where it
indexes the keys the tier holds). Keys given to and returned from it are (n, 2) uint64 arrays (a 16-byte key
read as two little-endian words), never copied per key; ``key_array`` makes one from a list of bytes keys.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.envvars import ENV_NATIVE_CPU
from kvtier.keys import KEY_BYTES, check_keys

log = logging.getLogger(__name__)

EMPTY, LIVE, TOMBSTONE = 0, 1, 2
MAX_LOAD = 0.7  # live + tombstones per slot before growing; linear probing degrades fast above ~0.75
MIN_CAPACITY = 1024
# A multiply-xorshift mix: keys are hash outputs already, but a test or a client may send structured keys
# (counters, zeros), and linear probing punishes clustered home slots hard.
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)
_SHIFT = np.uint64(31)
WINDOW = 8  # slots examined per probe round
_WINDOW_STEPS = np.arange(WINDOW, dtype=np.int64)


def _load_native() -> ctypes.CDLL | None:
    """The probe loops of native/cpu/keytable.c (in kvtier's native CPU library), or None: numpy does them."""
    if os.environ.get(ENV_NATIVE_CPU, "1") == "0":
        return None
    spec = importlib.util.find_spec("kvtier._native_cpu")
    lib = ctypes.CDLL(spec.origin) if spec is not None and spec.origin else None
    if lib is None or not hasattr(lib, "kvtier_keytable_find"):
        log.warning("kvtier native key-table probes not built; the master probes with numpy (about 3x slower "
                    "lookups; reinstall kvtier with a C compiler present)")
        return None
    p = ctypes.c_void_p
    for name in ("kvtier_keytable_find", "kvtier_keytable_place"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, ctypes.c_uint64, p, ctypes.c_int64, p]
        fn.restype = ctypes.c_int64
    return lib


_native = _load_native()


def as_key_array(blob: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """View n*16 bytes as an (n, 2) uint64 key array without copying. Raises ValueError on a ragged blob."""
    if isinstance(blob, np.ndarray):
        if blob.dtype == np.uint64 and blob.ndim == 2 and blob.shape[1] == 2:
            return blob
        raise ValueError(f"a key array must be (n, 2) uint64, got {blob.dtype} {blob.shape}")
    if len(blob) % 16:
        raise ValueError(f"a key blob must be a multiple of 16 bytes, got {len(blob)}")
    return np.frombuffer(blob, dtype="<u8").reshape(-1, 2)


def key_array(keys: Sequence[bytes]) -> np.ndarray:
    """The (n, 2) uint64 array of a batch of 16-byte ``bytes`` keys: one join, no per-key Python work.

    ValueError (naming the first bad key) unless the batch joins to 16 bytes per key. What the join cannot
    see, a short key beside a long one whose lengths still sum to 16 each, is read in 16-byte chunks that
    straddle them: a caller's bug that costs that batch its answers (a chunk is some key only by chance).
    """
    try:
        blob = b"".join(keys)
    except TypeError:
        blob = b""  # not bytes-like: check_keys names it
    if len(blob) != KEY_BYTES * len(keys):
        check_keys(keys)  # raises, naming the first key of the wrong length or type
        raise ValueError(f"{len(keys)} keys join to {len(blob)} bytes, not {KEY_BYTES} each")
    return np.frombuffer(blob, dtype="<u8").reshape(-1, 2)


def key_bytes(keys: np.ndarray) -> list[bytes]:
    """The 16-byte keys of an (n, 2) array as bytes objects (for answers that name keys)."""
    raw = np.ascontiguousarray(keys, dtype="<u8").tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


class KeyTable:
    """Batch find / insert / delete of 16-byte keys; slots index the columns added with ``add_column``."""

    def __init__(self, capacity: int = MIN_CAPACITY, native: bool = True) -> None:
        self.native = _native if native else None  # tests run both paths against each other
        cap = MIN_CAPACITY
        while cap < capacity:
            cap *= 2
        self._alloc(cap)
        self._columns: dict[str, tuple[np.ndarray, Callable[[int], np.ndarray]]] = {}
        self.live = 0
        self.tombstones = 0
        self.generation = 0  # bumped by every rehash: slot indices from before it are void

    def _alloc(self, cap: int) -> None:
        self.capacity = cap
        self._mask = np.uint64(cap - 1)
        self._imask = cap - 1
        self.state = np.zeros(cap, np.uint8)
        # Two contiguous word columns, not one (cap, 2) array: take() on a strided view copies the whole column.
        self.k0 = np.zeros(cap, np.uint64)
        self.k1 = np.zeros(cap, np.uint64)
        # Their addresses for the native probes, read once (``.ctypes`` builds an object per read).
        self._columns_at = (self.k0.ctypes.data, self.k1.ctypes.data, self.state.ctypes.data)

    # ---- columns ---------------------------------------------------------------------------------------

    def add_column(self, name: str, make: Callable[[int], np.ndarray]) -> np.ndarray:
        """Attach a per-slot column; ``make(capacity)`` builds it zero-filled. Returns the current array.

        Callers must re-read ``column(name)`` after any call that may rehash (insert, reserve, delete).
        """
        arr = make(self.capacity)
        if arr.shape[0] != self.capacity:
            raise ValueError(f"column {name!r}: first dimension must be the capacity {self.capacity}")
        self._columns[name] = (arr, make)
        return arr

    def column(self, name: str) -> np.ndarray:
        return self._columns[name][0]

    def replace_column(self, name: str, arr: np.ndarray) -> None:
        """Swap in a reshaped column (e.g. more mask words); the first dimension must stay the capacity."""
        if arr.shape[0] != self.capacity:
            raise ValueError(f"column {name!r}: first dimension must be the capacity {self.capacity}")
        make = self._columns[name][1]
        self._columns[name] = (arr, make)

    def set_column_maker(self, name: str, make: Callable[[int], np.ndarray]) -> None:
        self._columns[name] = (self._columns[name][0], make)

    def clear(self) -> None:
        """Forget every key (the columns are rebuilt empty, at the smallest capacity)."""
        makers = {name: make for name, (_, make) in self._columns.items()}
        self._alloc(MIN_CAPACITY)
        self._columns = {name: (make(MIN_CAPACITY), make) for name, make in makers.items()}
        self.live = self.tombstones = 0
        self.generation += 1

    @property
    def nbytes(self) -> int:
        """Bytes held by the table and its columns (what the master pays per slot, times capacity)."""
        return self.state.nbytes + self.k0.nbytes + self.k1.nbytes + sum(a.nbytes for a, _ in self._columns.values())

    # ---- batch operations ------------------------------------------------------------------------------

    def _home(self, q: np.ndarray) -> np.ndarray:
        h = (q[:, 0] ^ (q[:, 1] * _MIX1)) * _MIX2
        return ((h ^ (h >> _SHIFT)) & self._mask).astype(np.int64)

    def find(self, q: np.ndarray) -> np.ndarray:
        """Slot of each key, or -1 where absent. ``q``: (n, 2) uint64."""
        n = len(q)
        out = np.full(n, -1, np.int64)
        if n == 0 or self.live == 0:
            return out
        if self.native is not None:
            q = np.ascontiguousarray(q, dtype=np.uint64)
            self.native.kvtier_keytable_find(*self._columns_at, self._imask, _address(q), n, _address(out))
            return out
        q0, q1 = np.ascontiguousarray(q[:, 0]), np.ascontiguousarray(q[:, 1])
        k0, k1, state, imask = self.k0, self.k1, self.state, self._imask
        # Round one looks at each key's home slot only: at load <= 0.7 most keys resolve there, and a
        # one-slot gather over the whole batch is the cheapest pass there is.
        idx = self._home(q)
        st = state.take(idx)
        hit = (k0.take(idx) == q0) & (k1.take(idx) == q1) & (st == LIVE)
        out[hit] = idx[hit]
        pending = np.flatnonzero(~hit & (st != EMPTY))
        start = (idx[pending] + 1) & imask
        while pending.size:
            # The rest probe a window of WINDOW slots per round (one vectorized pass per round).
            widx = (start[:, None] + _WINDOW_STEPS) & imask
            wst = state.take(widx)
            match = (k0.take(widx) == q0[pending, None]) & (k1.take(widx) == q1[pending, None]) & (wst == LIVE)
            found = _rows_any(match)
            if found.any():
                rows = np.flatnonzero(found)
                out[pending[rows]] = widx[rows, match[rows].argmax(axis=1)]
            # A key is never stored past an EMPTY slot of its probe path (deletes leave tombstones).
            cont = ~found & ~_rows_any(wst == EMPTY)
            pending = pending[cont]
            start = (start[cont] + WINDOW) & imask
        return out

    def insert(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot of each key, inserting the absent ones. Returns (slots, is_new). Duplicates in ``q`` share a slot.

        May grow the table (every column moves): re-read columns after this call.
        """
        slots = self.find(q)
        missing = np.flatnonzero(slots < 0)
        is_new = np.zeros(len(q), bool)
        if missing.size == 0:
            return slots, is_new
        mq = q[missing]
        # One slot per distinct key: duplicates inside the batch map to their first occurrence.
        _, first, inverse = np.unique(mq.view(np.dtype((np.void, 16))).ravel(), return_index=True,
                                      return_inverse=True)
        uq = mq[first]
        self.reserve(len(uq))
        new_slots = self._place(uq)
        slots[missing] = new_slots[inverse.ravel()]
        is_new[missing[first]] = True
        return slots, is_new

    def add(self, q: np.ndarray, *, absent: bool = False) -> None:
        """Insert distinct keys (those present already stay as they are): ``insert`` without its pass that
        groups repeats within the batch (a sort), for a caller whose batch has none (the DRAM tier's commit).
        ``absent``: the caller knows no key of ``q`` is in the table, so none is looked for first (a key that
        is would then be in it twice: the caller's bug)."""
        missing = q if absent else q[self.find(q) < 0]
        if len(missing):
            self.reserve(len(missing))
            self._place(missing)

    def delete(self, slots: np.ndarray) -> None:
        """Turn live slots into tombstones (columns are left as they are; reused slots are reset on insert)."""
        slots = np.unique(slots[slots >= 0])
        slots = slots[self.state[slots] == LIVE]
        self.state[slots] = TOMBSTONE
        self.live -= len(slots)
        self.tombstones += len(slots)
        if self.tombstones > self.capacity // 4:
            self._rehash(self.capacity)

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more keys without passing the load limit."""
        need = self.live + self.tombstones + extra
        if need <= self.capacity * MAX_LOAD:
            return
        cap = self.capacity
        while (self.live + extra) > cap * MAX_LOAD:
            cap *= 2
        self._rehash(cap)

    def live_slots(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Indices of live slots in [start, stop)."""
        stop = self.capacity if stop is None else min(stop, self.capacity)
        return np.flatnonzero(self.state[start:stop] == LIVE) + start

    # ---- internals -------------------------------------------------------------------------------------

    def _place(self, q: np.ndarray) -> np.ndarray:
        """Put distinct absent keys into the first free (empty or tombstone) slot of their probe path."""
        n = len(q)
        out = np.empty(n, np.int64)
        if self.native is not None:
            q = np.ascontiguousarray(q, dtype=np.uint64)
            reused = self.native.kvtier_keytable_place(*self._columns_at, self._imask, _address(q), n, _address(out))
            if reused < 0:  # cannot happen below MAX_LOAD; a loud failure beats a silent loop
                raise RuntimeError(f"key table full at capacity {self.capacity}")
            self.tombstones -= reused
            self.live += n
            for arr, _ in self._columns.values():
                arr[out] = 0
            return out
        start = self._home(q)
        pending = np.arange(n)
        state = self.state
        while pending.size:
            idx = (start[:, None] + _WINDOW_STEPS) & self._imask
            free = state.take(idx) != LIVE
            has_free = free.any(axis=1)
            first_free = idx[np.arange(len(idx)), free.argmax(axis=1)]
            cand, cslot = pending[has_free], first_free[has_free]
            # Keys that picked the same slot: the first wins, the others look again from the same start.
            slots, first = np.unique(cslot, return_index=True)
            winners = cand[first]
            self.tombstones -= int(np.count_nonzero(state[slots] == TOMBSTONE))
            state[slots] = LIVE
            self.k0[slots] = q[winners, 0]
            self.k1[slots] = q[winners, 1]
            out[winners] = slots
            for arr, _ in self._columns.values():
                arr[slots] = 0
            won = np.zeros(n, bool)
            won[winners] = True
            keep = ~won[pending]
            advance = ~has_free[keep]
            pending, start = pending[keep], start[keep]
            start[advance] = (start[advance] + WINDOW) & self._imask
        self.live += n
        return out

    def _rehash(self, cap: int) -> None:
        old_live = np.flatnonzero(self.state == LIVE)
        old_keys = np.stack([self.k0[old_live], self.k1[old_live]], axis=1)
        old_cols = {name: arr[old_live] for name, (arr, _) in self._columns.items()}
        makers = {name: make for name, (_, make) in self._columns.items()}
        self._alloc(cap)
        self.generation += 1
        self.live = 0
        self.tombstones = 0
        self._columns = {name: (makers[name](cap), makers[name]) for name in makers}
        new = self._place(old_keys)
        for name, (arr, _) in self._columns.items():
            arr[new] = old_cols[name]


def _address(a: np.ndarray) -> int:
    """The data address of a contiguous array (cheaper than ``a.ctypes.data``)."""
    return a.__array_interface__["data"][0]


def _rows_any(b: np.ndarray) -> np.ndarray:
    """Row-wise any() of an (n, WINDOW) bool array, reading each 8 bools as one uint64 word (a reduce over
    WINDOW columns costs more than the rest of a probe round)."""
    words = b.view(np.uint64)
    if words.shape[1] == 1:
        return words.ravel() != 0
    return np.bitwise_or.reduce(words, axis=1) != 0
