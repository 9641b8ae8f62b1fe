"""gather / scatter: check the call, pick a backend, stage through the engine's device when needed.

Backends (one module each) move bytes for an already validated call; this module owns everything they
share: block-id tables, packed-row addresses, the automatic choice, and staging for packed buffers a
backend cannot address directly (a packed host buffer for a kernel that only addresses device memory).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.blocks import BlockRows
from kvtier.kernels.enginekv import EngineKV

log = logging.getLogger(__name__)

SKIP = -1  # block id meaning "this cache group has no engine block here" (gather writes zeros, scatter skips)
STAGING_BYTES = 256 << 20  # device scratch per staged call; larger batches go through it in chunks


class BackendUnavailable(RuntimeError):
    """A backend forced by name cannot run here; the message says why."""


class KernelError(RuntimeError):
    """A copy kernel failed to launch or run (a CUDA error code, a Triton compile error)."""


@dataclass
class PackedRows:
    """Row ``i`` of the packed batch starts at ``ptrs[i]`` on ``device``; ``tensor`` is the caller's (N, nbytes)
    tensor when it passed one (None for a BlockRows address table), kept alive for the call."""

    ptrs: np.ndarray
    device: torch.device
    tensor: torch.Tensor | None

    def rows(self, start: int, stop: int) -> PackedRows:
        return PackedRows(self.ptrs[start:stop], self.device,
                          None if self.tensor is None else self.tensor[start:stop])


class Backend(Protocol):
    """Moves the bytes of a checked call. Runs in the caller's thread; GPU backends enqueue on the engine
    device's current stream and return before the copy is done (synchronize the stream before reading or
    reusing the buffers); the CPU backends return when it is done."""

    name: str

    def unavailable(self, kv: EngineKV) -> str | None:
        """None if this backend can copy for ``kv`` here, else the reason it cannot."""

    def prepare(self, kv: EngineKV, rows: PackedRows) -> PackedRows | None:
        """``rows`` as this backend addresses them (e.g. host addresses mapped for the GPU), or None if it
        cannot reach them and the call must go through staging on the engine's device."""

    def copy(self, kv: EngineKV, ids: np.ndarray, rows: PackedRows, scatter: bool, align: int,
             threads: int) -> None:
        """Gather (scatter=False) or scatter every fragment of ``len(rows.ptrs)`` blocks."""


# name -> module with a BACKEND object; loaded only when asked for (triton and cuda imports are heavy).
BACKENDS = {
    "cuda": "kvtier.kernels.cuda",
    "triton": "kvtier.kernels.triton_copy",
    "cpu": "kvtier.kernels.cpu",
    "torch": "kvtier.kernels.torchcopy",
}
AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}
_auto: weakref.WeakKeyDictionary[EngineKV, Backend] = weakref.WeakKeyDictionary()  # "auto", once per map


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; known: auto, {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).BACKEND  # type: ignore[no-any-return]


def backend_status(kv: EngineKV) -> dict[str, str | None]:
    """Every backend's reason it cannot run for ``kv`` here (None: it can)."""
    status = {}
    for name in BACKENDS:
        try:
            status[name] = backend(name).unavailable(kv)
        except ImportError as e:  # triton missing, or broken
            status[name] = f"cannot import: {e}"
    return status


def pick_backend(kv: EngineKV, name: str = "auto") -> Backend:
    """The backend for ``name`` ("auto": the fastest that can run for ``kv``'s device here)."""
    if name != "auto":
        chosen = backend(name)
        reason = chosen.unavailable(kv)
        if reason:
            raise BackendUnavailable(f"kernel backend {name!r} cannot run here: {reason}")
        return chosen
    chosen = _auto.get(kv)
    if chosen is None:
        chosen = _auto[kv] = _first_available(kv)
        log.info("packed-block copies for %s use the %s backend", kv.describe(), chosen.name)
    return chosen


def _first_available(kv: EngineKV) -> Backend:
    reasons = []
    for candidate in AUTO_ORDER.get(kv.device.type, ("torch",)):
        if candidate == "triton" and importlib.util.find_spec("triton") is None:
            continue
        try:
            chosen = backend(candidate)
        except ImportError as e:
            reasons.append(f"{candidate}: {e}")
            continue
        reason = chosen.unavailable(kv)
        if reason is None:
            return chosen
        reasons.append(f"{candidate}: {reason}")
    raise BackendUnavailable(f"no kernel backend for KV on {kv.device}: " + "; ".join(reasons))


def gather(kv: EngineKV, block_ids: Any, packed: Any, *, backend: str = "auto", threads: int = 1) -> str:
    """Copy engine blocks ``block_ids`` into packed blocks: row i of ``packed`` <- engine block(s) ids[i].

    ``block_ids``: one id per packed block (any order, repeats allowed), used for every cache group; or a
    (groups, N) array / ``{group: ids}`` for hybrid models whose groups keep separate block tables. An id of
    ``SKIP`` (-1) means the group has no block there; its regions are zeroed. ``packed``: an (N,
    layout.nbytes) uint8 tensor (host, pinned host, or device memory; rows may be strided), or a BlockRows
    of host addresses (e.g. DRAM tier slots). ``backend``: "auto" or a name in BACKENDS; ``threads``: CPU
    threads for the cpu backend. Returns the backend's name. GPU backends are asynchronous on the current
    stream (see Backend). Raises ValueError for bad ids or buffers, BackendUnavailable, KernelError.
    """
    return _run(kv, block_ids, packed, scatter=False, name=backend, threads=threads)


def scatter(kv: EngineKV, block_ids: Any, packed: Any, *, backend: str = "auto", threads: int = 1) -> str:
    """Copy packed blocks back into engine blocks: engine block(s) ids[i] <- row i of ``packed``.

    Arguments as in gather; ids must not repeat within a group (two blocks into one engine block), and
    ``SKIP`` leaves that group's engine memory untouched.
    """
    return _run(kv, block_ids, packed, scatter=True, name=backend, threads=threads)


def _run(kv: EngineKV, block_ids: Any, packed: Any, *, scatter: bool, name: str, threads: int) -> str:
    ids = block_id_table(kv, block_ids, scatter)
    n = ids.shape[1]
    rows = packed_rows(packed, n, kv.block_bytes, "packed")
    chosen = pick_backend(kv, name)
    if n == 0:
        return chosen.name
    direct = chosen.prepare(kv, rows)
    if direct is not None:
        chosen.copy(kv, ids, direct, scatter, _alignment(kv, direct.ptrs), threads)
    else:
        _staged(chosen, kv, ids, rows, scatter, threads)
    return chosen.name


def block_id_table(kv: EngineKV, block_ids: Any, scatter: bool) -> np.ndarray:
    """``block_ids`` as an int64 (kv.id_rows, N) table, checked against each group's engine block count."""
    groups = [g.name for g in kv.layout.groups]
    if isinstance(block_ids, Mapping):
        unknown = set(block_ids) - set(groups)
        if unknown:
            raise ValueError(f"block_ids: unknown cache group(s) {sorted(unknown)}; groups: {groups}")
        missing = [g for g in groups if g not in block_ids]
        if missing:
            raise ValueError(f"block_ids: no ids for cache group(s) {missing}")
        rows = [_as_ids(block_ids[g]) for g in groups]
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"block_ids: the groups' id lists differ in length ({sorted(lengths)})")
        table = np.stack(rows)
    else:
        arr = _as_ids(block_ids, allow_2d=True)
        if arr.ndim == 1:
            table = np.repeat(arr[None, :], len(groups), axis=0)
        elif arr.shape[0] == len(groups):
            table = arr
        else:
            raise ValueError(f"block_ids: a 2-D table needs one row per cache group ({len(groups)}), got "
                             f"shape {arr.shape}")
    table = np.ascontiguousarray(table, dtype=np.int64)
    for g, row in zip(groups, table):
        limit = kv.num_blocks[g]
        bad = np.flatnonzero((row < SKIP) | (row >= limit))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"block_ids[{i}] = {row[i]} is out of range for cache group {g!r} "
                             f"(engine blocks 0..{limit - 1}, or {SKIP} to skip)")
        if scatter:
            used = row[row >= 0]
            if len(np.unique(used)) != len(used):
                raise ValueError(f"block_ids: scatter into cache group {g!r} names an engine block twice")
    if kv.id_rows > len(groups):  # the padding pseudo-group: always SKIP
        table = np.concatenate([table, np.full((1, table.shape[1]), SKIP, dtype=np.int64)])
    return table


def _as_ids(x: Any, allow_2d: bool = False) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()  # a device tensor costs a sync here: pass host ids where you can
    arr = np.asarray(x)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"block_ids must be integers, got {arr.dtype}")
    if arr.ndim != 1 and not (allow_2d and arr.ndim == 2):
        raise ValueError(f"block_ids must be 1-D{' or (groups, N)' if allow_2d else ''}, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def packed_rows(packed: Any, n: int, nbytes: int, what: str) -> PackedRows:
    """Check ``packed`` holds ``n`` writable rows of ``nbytes`` and return their addresses."""
    if isinstance(packed, BlockRows):
        if len(packed.ptrs) != n:
            raise ValueError(f"{what}: {n} block ids but {len(packed.ptrs)} packed rows")
        return PackedRows(np.asarray(packed.ptrs, dtype=np.uint64), torch.device("cpu"), None)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{what}: expected an (N, {nbytes}) uint8 tensor or BlockRows, got {type(packed).__name__}")
    if packed.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"{what}: expected a uint8 tensor, got {packed.dtype}")
    if packed.dim() != 2 or tuple(packed.shape) != (n, nbytes):
        raise ValueError(f"{what}: expected shape ({n}, {nbytes}) (one packed block per block id), got "
                         f"{tuple(packed.shape)}")
    if n and (packed.stride(1) != 1 or (n > 1 and packed.stride(0) < nbytes)):
        raise ValueError(f"{what}: each row must be contiguous and rows must not overlap (strides "
                         f"{packed.stride()})")
    base = packed.data_ptr()
    ptrs = (np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(packed.stride(0))) if n else \
        np.empty(0, np.uint64)
    return PackedRows(ptrs, packed.device, packed)


def _alignment(kv: EngineKV, ptrs: np.ndarray) -> int:
    align = kv.align
    if len(ptrs):
        low = int(np.bitwise_or.reduce(ptrs & np.uint64(15)))
        while align > 1 and low % align:
            align //= 2
    return align


def _staged(be: Backend, kv: EngineKV, ids: np.ndarray, rows: PackedRows, scatter: bool, threads: int) -> None:
    """Copy through scratch rows on the engine's device, in chunks of at most STAGING_BYTES."""
    if rows.tensor is None:
        raise ValueError(f"the {be.name} backend cannot address host rows given as BlockRows; pass a pinned "
                         "host tensor, or use the cpu backend for CPU engine tensors")
    if rows.tensor.device.type == "cpu" and kv.device.type == "cuda" and not rows.tensor.is_pinned():
        _warn_once(f"packed host buffer is not pinned: {be.name} copies go through synchronous staging")
    n = ids.shape[1]
    chunk = max(1, min(n, STAGING_BYTES // kv.block_bytes))
    scratch = torch.empty((chunk, kv.block_bytes), dtype=torch.uint8, device=kv.device)
    staging = be.prepare(kv, packed_rows(scratch, chunk, kv.block_bytes, "scratch"))
    if staging is None:
        raise BackendUnavailable(f"the {be.name} backend cannot address memory on {kv.device}")
    align = _alignment(kv, staging.ptrs)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        part = np.ascontiguousarray(ids[:, start:start + m])
        # One stream orders each chunk's copy before the kernel that next reuses the scratch rows.
        if scatter:
            scratch[:m].copy_(rows.tensor[start:start + m], non_blocking=True)
            be.copy(kv, part, staging.rows(0, m), True, align, threads)
        else:
            be.copy(kv, part, staging.rows(0, m), False, align, threads)
            rows.tensor[start:start + m].copy_(scratch[:m], non_blocking=True)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def upload_ids_and_rows(ids: np.ndarray, rows: PackedRows, device: torch.device) -> torch.Tensor:
    """Block ids then row addresses as one int64 tensor on ``device``, copied without waiting for the stream.

    For a GPU the bytes go through torch's pinned host cache (a pageable source could make the copy wait for
    the stream's earlier work); the caching allocators keep both buffers until the stream has used them, so
    nothing here needs to outlive the call.
    """
    meta = torch.from_numpy(np.concatenate([ids.ravel(), rows.ptrs.view(np.int64)]))
    if device.type == "cpu":
        return meta
    return meta.pin_memory().to(device, non_blocking=True)


def triton_interpreted() -> bool:
    """Triton runs kernels on CPU tensors only in its interpreter (TRITON_INTERPRET=1 before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
