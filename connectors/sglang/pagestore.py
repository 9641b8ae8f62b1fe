"""PageStore: SGLang host-pool pages in and out of a TieredStore, with the fewest copies each layout allows.

Runs in an SGLang scheduler process (one per rank), called from SGLang's prefetch, IO, backup and scheduler
threads at once: every method is thread-safe (the store is; the staging rows are one lock per direction).
Buffers: the host pool's pages are read and written only inside a call (SGLang keeps a node's host pages
locked until the call returns); nothing keeps a host address after it.

Copies per page and direction (the host pool's page <-> a kvtier tier):

* one segment (MLA ``page_first*``): the store reads and writes the host page itself; every tier (DRAM,
  the node pool's shared memory, a remote pool's socket, SSD) copies straight to or from it: no copy of ours.
* several segments (MHA: K and V, or every layer's K and V; MLA ``layer_first``): saves gather the segments
  straight into the DRAM slots the store reserved (``put_in_place``): one copy, the one the tier needs
  anyway. Loads of pages in DRAM scatter straight from their slots (``borrow``): one copy. Pages found only
  on the SSD or in a pool come through staging rows (``get``, then a scatter): one copy more; so do saves
  where the node pool is the top tier (standalone mode without a private DRAM tier: gather, then ``put``).

Keys: SGLang's page keys (hex strings) folded into the rank's namespace (identity.py). Events: put and get
run inside ``naming`` (kvtier.connectors.tier_events) so the KV events carry SGLang's page keys.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.blocks import BlockRows, block_rows
from kvtier.memory.hostmem import HostBuffer
from kvtier.keys import Namespace
from kvtier.store.leases import session_lease
from kvtier.store import TieredStore

from kvtier.connectors.hints import AgentHints

from .pages import HostPages

Naming = Callable[[Sequence[bytes], Sequence[str]], AbstractContextManager[None]]


# Pages moved by each path (how many copies each costs: the module docstring).
COUNTERS = (
    "saved_in_place",  # put straight from the host page, or gathered straight into DRAM slots
    "saved_staged",  # gathered into staging rows, then put
    "loaded_direct",  # read straight into the host page, or scattered straight from DRAM slots
    "loaded_staged",  # read into staging rows, then scattered
    "skipped",  # saves of pages the store already held or was writing
    "rejected",  # saves refused (no evictable space)
    "missed",  # loads of pages the store did not have
)


class _Staging:
    """``rows`` host rows of ``block_bytes``, allocated on first use, lent to one caller at a time."""

    def __init__(self, rows: int, block_bytes: int) -> None:
        self.rows, self.block_bytes = rows, block_bytes
        self._lock = threading.Lock()
        self._buffer: HostBuffer | None = None

    @contextmanager
    def lend(self) -> Iterator[torch.Tensor]:
        with self._lock:
            if self._buffer is None:
                self._buffer = HostBuffer(self.rows * self.block_bytes)
            yield self._buffer.tensor.view(self.rows, self.block_bytes)

    def close(self) -> None:
        with self._lock:
            if self._buffer is not None:
                self._buffer.close()
                self._buffer = None


@dataclass
class PageStore:
    """One rank's pages in ``store`` under ``namespace``: thread-safe (any of SGLang's threads, at once); reads and
    writes the host pool only inside a call; owns its staging rows (freed by ``close``). ``naming`` names keys
    for the KV events (None: no events). The copies per layout: the module docstring."""

    store: TieredStore
    namespace: Namespace
    pages: HostPages
    staging_bytes: int = 256 << 20
    naming: Naming | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def __post_init__(self) -> None:
        if self.store.block_bytes != self.pages.block_bytes:
            raise ValueError(f"the store holds blocks of {self.store.block_bytes} B but a page is "
                             f"{self.pages.block_bytes} B")
        rows = max(1, self.staging_bytes // self.pages.block_bytes)
        self._load_staging = _Staging(rows, self.pages.block_bytes)
        self._save_staging = _Staging(rows, self.pages.block_bytes)
        self._lock = threading.Lock()

    # ---- the calls SGLang makes ----------------------------------------------------------------------------

    def keys(self, page_keys: Sequence[str]) -> list[bytes]:
        return self.namespace.keys(page_keys)

    def exists(self, page_keys: Sequence[str]) -> int:
        """How many leading pages some tier holds: one store lookup (one call per tier) for the whole span."""
        return self.store.lookup_prefix(self.keys(page_keys)).length if page_keys else 0

    def set_pages(self, page_keys: Sequence[str], host_indices: torch.Tensor, hints: AgentHints | None = None
                  ) -> list[bool]:
        """Store the host pages at ``host_indices`` under ``page_keys``; True where the store holds the page
        afterwards (stored now, held already, or being written by another call)."""
        n = len(page_keys)
        segments = self.pages.segment_ptrs(host_indices, n)
        keys = self.keys(page_keys)
        with self._named(keys, page_keys):
            if self.pages.contiguous:
                result = self.store.put(keys, BlockRows(segments[:, 0].copy(), (self.pages.pool,)))
                self._count(saved_in_place=result.stored)
            elif self.store.writes_in_place:
                result = self.store.put_in_place(keys, lambda index, slots: self.pages.to_blocks(
                    segments[index], slots.ptrs))
                self._count(saved_in_place=result.stored)
            else:
                return self._set_staged(keys, page_keys, segments, hints)
        self._count(skipped=result.skipped, rejected=len(result.rejected))
        self._lease(keys, hints)
        rejected = set(result.rejected)
        return [k not in rejected for k in keys]

    def get_pages(self, page_keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Load the pages of ``page_keys`` into the host pages at ``host_indices``; True where loaded (SGLang uses
        the leading run). A page not loaded may have been partly written (its host page is SGLang's to
        discard)."""
        n = len(page_keys)
        segments = self.pages.segment_ptrs(host_indices, n)
        keys = self.keys(page_keys)
        with self._named(keys, page_keys):
            if self.pages.contiguous:
                hit = self.store.get(keys, BlockRows(segments[:, 0].copy(), (self.pages.pool,)))
                self._count(loaded_direct=sum(hit), missed=n - sum(hit))
                return hit
            hit = [False] * n
            with self.store.borrow(keys) as addresses:
                direct = [i for i, a in enumerate(addresses) if a is not None]
                if direct:
                    slots = np.fromiter((addresses[i] for i in direct), dtype=np.uint64, count=len(direct))
                    self.pages.from_blocks(slots, segments[direct])
                    for i in direct:
                        hit[i] = True
            rest = [i for i in range(n) if not hit[i]]
            staged = self._get_staged([keys[i] for i in rest], segments[rest]) if rest else []
            for i, h in zip(rest, staged):
                hit[i] = h
        self._count(loaded_direct=len(direct), loaded_staged=sum(staged), missed=n - sum(hit))
        return hit

    def set_flat(self, page_keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        """``interface_v1`` off: store SGLang's flat data pages (one tensor per key, already a copy of SGLang's)."""
        keys = self.keys(page_keys)
        with self._named(keys, page_keys):
            result = self.store.put(keys, [v.contiguous().view(torch.uint8).view(-1) for v in values])
        self._count(saved_in_place=result.stored, skipped=result.skipped, rejected=len(result.rejected))
        rejected = set(result.rejected)
        return [k not in rejected for k in keys]

    def get_flat(self, page_keys: Sequence[str], targets: Sequence[torch.Tensor]) -> list[bool]:
        """``interface_v1`` off: read pages into SGLang's flat page tensors (contiguous, one per key)."""
        keys = self.keys(page_keys)
        for t in targets:
            if not t.is_contiguous():
                raise ValueError("flat page targets must be contiguous tensors")
        with self._named(keys, page_keys):
            hit = self.store.get(keys, [t.view(torch.uint8).view(-1) for t in targets])
        self._count(loaded_direct=sum(hit), missed=len(keys) - sum(hit))
        return hit

    def clear(self) -> int:
        """Remove every page this process's private tiers list (DRAM, SSD), from every tier of the store, and
        return how many blocks went. Pages only a shared pool holds stay (other servers' too)."""
        keys = self.store.local_keys()
        return self.store.remove(sorted(keys)) if keys else 0

    def take_counts(self) -> dict[str, int]:
        """The counters since the last call (and reset them)."""
        with self._lock:
            out, self.counts = self.counts, dict.fromkeys(COUNTERS, 0)
        return out

    def close(self) -> None:
        self._load_staging.close()
        self._save_staging.close()

    # ---- internals --------------------------------------------------------------------------------------

    def _set_staged(self, keys: list[bytes], page_keys: Sequence[str], segments: np.ndarray,
                    hints: AgentHints | None) -> list[bool]:
        """Saves where the top tier has no slots to fill: only pages the store lacks are gathered (one
        ``prepare_put`` answers that once per page, and claims the rest until they are written)."""
        ok = [True] * len(keys)
        stored = 0
        with self.store.prepare_put(keys) as plan, self._save_staging.lend() as rows:
            todo = plan.fresh
            for lo in range(0, len(todo), len(rows)):
                part = todo[lo : lo + len(rows)]
                staging = block_rows(rows[: len(part)], len(part), self.pages.block_bytes)
                self.pages.to_blocks(segments[part], staging.ptrs)
                result = plan.put(part, staging)
                stored += result.stored
                rejected = set(result.rejected)
                for i in part:
                    ok[i] = keys[i] not in rejected
        self._count(saved_staged=stored, skipped=plan.skipped, rejected=ok.count(False))
        self._lease(keys, hints)
        return ok

    def _get_staged(self, keys: list[bytes], segments: np.ndarray) -> list[bool]:
        """Pages not in DRAM: read into staging rows (the store reads the SSD or a pool, and promotes), then
        scattered into the host pages."""
        hit: list[bool] = []
        with self._load_staging.lend() as rows:
            for lo in range(0, len(keys), len(rows)):
                part = keys[lo : lo + len(rows)]
                staging = block_rows(rows[: len(part)], len(part), self.pages.block_bytes, writable=True)
                got = self.store.get(part, staging)
                index = [j for j, h in enumerate(got) if h]
                if index:
                    self.pages.from_blocks(staging.ptrs[index], segments[lo:lo + len(part)][index])
                hit += got
        return hit

    def _lease(self, keys: list[bytes], hints: AgentHints | None) -> None:
        if hints is not None:
            self.store.leases.lease(session_lease(hints.session), keys, hints.ttl_s, hints.priority)

    def _named(self, keys: Sequence[bytes], page_keys: Sequence[str]) -> AbstractContextManager[None]:
        return self.naming(keys, page_keys) if self.naming is not None else nullcontext()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v
