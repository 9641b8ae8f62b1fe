"""How a put reaches a TieredStore's top tier: ``PutPlan``, one put's answer per key (what TieredStore.prepare_put
claimed), and ``TopWrites``, the writes themselves (copied, or filled in place into the top tier's slots), with
what follows every write: one retry after expired leases are released, the offloads of what went in (or could
not), the sightings second_hit counts, and the store's count and announcement.

Split from tiered.py by role: the store decides which keys a put writes (once); this module writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.blocks import BlockRows, block_rows
from kvtier.offload import Offloader, Sightings
from kvtier.store.types import Fill, PutResult
from kvtier.tiers.base import AddressableSlots, Tier

# One in-place write's scratch rows for the blocks the top tier did not take but a lower tier may (freed when the
# write returns: a lower tier with write-behind has copied them into its staging memory by then).
MAX_SCRATCH_BYTES = 256 << 20

# What the store does with one write's outcome (counts, logs, announces it): (keys written, keys stored).
Stored = Callable[[Sequence[bytes], list[bytes]], PutResult]


class TopWrites:
    """Writes blocks into ``top``, the store's top tier, and hands them to the ``offloads`` below it.

    Built once by the store; thread-safe as its parts are (the top tier and the offloaders lock for
    themselves). ``reclaim()`` releases expired leases' pins and returns how many (> 0: a write that found no
    room is tried once more); ``stored`` is the store's bookkeeping of each write.
    """

    def __init__(self, top: Tier, offloads: Sequence[Offloader], sightings: Sightings | None,
                 reclaim: Callable[[], int], stored: Stored, block_bytes: int, dtypes: Sequence[str]) -> None:
        self.top = top
        self.slots: AddressableSlots | None = top if isinstance(top, AddressableSlots) else None
        self.block_bytes = block_bytes
        self.dtypes = tuple(dtypes)
        self._offloads = list(offloads)
        self._sightings = sightings
        self._reclaim = reclaim
        self._stored = stored

    def copy(self, keys: list[bytes], rows: BlockRows) -> PutResult:
        """Copy ``rows`` (one per key) into the top tier; what it had no room for goes down as if evicted at
        once (write_through: the whole batch)."""
        stored = self.top.put(keys, rows) if keys else []
        if not all(stored) and self._reclaim():  # expired leases held the space: try once more
            retry = [i for i, ok in enumerate(stored) if not ok]
            for i, ok in zip(retry, self.top.put([keys[i] for i in retry], rows.take(retry))):
                stored[i] = ok
        new_keys = list(keys) if all(stored) else [k for k, ok in zip(keys, stored) if ok]
        result = self._stored(keys, new_keys)
        if self._sightings is not None:
            self._sightings.see(keys)  # stored or refused: either is a sighting
        if self._offloads and keys:
            stored_rows = rows.take([i for i, ok in enumerate(stored) if ok])
            refused_rows = rows.take([i for i, ok in enumerate(stored) if not ok])
            for offload in self._offloads:
                offload.after_put(new_keys, stored_rows, result.rejected, refused_rows)
        return result

    def fill(self, keys: list[bytes], positions: list[int], fill: Fill, protect: Sequence[bytes]) -> PutResult:
        """Reserve top-tier slots for ``keys`` (at ``positions`` of their plan), let ``fill(positions, slots)``
        write the reserved ones, publish them. Never evicts a block of ``protect`` for them. Keys the top tier
        did not take that an offload would write down (``_handed_down``) are filled into scratch rows in the
        same call and handed to the offloads, as ``copy`` hands down its refused rows. If ``fill`` or a
        write-through offload raises, nothing is published, every slot is freed and the exception propagates."""
        top = self.slots
        if top is None:
            raise TypeError(f"the top tier {self.top.name!r} has no addressable slots to fill in place; use put")
        reservations: list[tuple[Any, list[int]]] = []  # (a tier reservation, its slots' positions in the plan)
        try:
            # A protected block evicted meanwhile is simply not protected: it is not reserved either.
            todo = list(range(len(keys)))
            while todo:
                res = top.reserve([keys[i] for i in todo], protect=protect)
                reservations.append((res, []))  # first, so any error below still gives its slots back
                reservations[-1] = (res, [positions[todo[j]] for j in res.index])
                todo = [i for i, h in zip(todo, res.held) if not h]
                if not todo or len(reservations) == 2 or not self._reclaim():  # expired leases held the space
                    break
            index = [i for _, reserved in reservations for i in reserved]
            new_keys = [k for r, _ in reservations for k in r.keys]  # the reserved keys, in index's order
            # What the top tier did not take (its policy declined it, or nothing was evictable) goes down as the
            # copy path sends it (its offloads' own rules), so the fill writes it into scratch rows instead.
            down = self._handed_down([keys[i] for i in todo])
            down_keys = [keys[todo[j]] for j in down]
            scratch = np.empty((len(down), self.block_bytes), np.uint8)
            down_rows = BlockRows(scratch.ctypes.data + np.arange(len(down), dtype=np.uint64)
                                  * np.uint64(self.block_bytes), (scratch,))
            if index or down:
                addresses = [r.addresses for r, _ in reservations]
                fill(index + [positions[todo[j]] for j in down],
                     BlockRows(np.concatenate([*addresses, down_rows.ptrs]), (top, scratch)))
                slots = BlockRows(np.concatenate(addresses), (top,))
                # Offloaded before the commit, while the slots are reserved: once published, a concurrent
                # remove or eviction could give a slot to another block while write-through reads it.
                if self._sightings is not None:
                    self._sightings.see(new_keys + [keys[i] for i in todo])  # stored or not: a sighting
                for offload in self._offloads:
                    offload.after_put(new_keys, slots, down_keys, down_rows)
        except BaseException:
            for res, _ in reservations:
                top.commit(res, success=False)
            raise
        for res, _ in reservations:
            top.commit(res)
        return self._stored(keys, new_keys)

    def _handed_down(self, keys: list[bytes]) -> list[int]:
        """Positions of ``keys`` (the top tier did not take them) that some offload would write down, at most
        MAX_SCRATCH_BYTES of them (the rest are lost, as when no lower tier has room: counted as rejected)."""
        if not keys or not self._offloads:
            return []
        due = sorted(set().union(*(offload.due_on_eviction(keys, count=False) for offload in self._offloads)))
        return due[: max(1, MAX_SCRATCH_BYTES // self.block_bytes)]


class PutPlan:
    """One put's answer per key, given once (``TieredStore.prepare_put``) and used by each of its writes.

    ``keys`` the batch; ``fresh`` the positions this put claimed (held neither by the top tier nor by a local
    one, written by no other put); ``top_held`` the batch's keys the top tier holds (its writes never evict
    them for the new blocks); ``skipped`` how many keys were not fresh. ``put(positions, blocks)`` copies
    blocks (one per position) into the top tier, ``put_in_place(positions, fill)`` lets ``fill`` write them
    into its slots (``fill(index, slots)``: ``index`` are positions in ``keys``); positions must be fresh ones,
    each written once, before the ``prepare_put`` block exits. Each write returns its own PutResult (``skipped``
    0: the plan's skips are ``skipped``; ``skipping(result)`` adds them). Used on the thread that prepared it.
    """

    def __init__(self, writes: TopWrites, keys: list[bytes], fresh: list[int], top_held: list[bytes]) -> None:
        self._writes = writes
        self.keys = keys
        self.fresh = fresh
        self.top_held = top_held
        self.skipped = len(keys) - len(fresh)
        self._claimed: set[int] | None = None  # None: every fresh position is still to write (no set built)

    def put(self, positions: Sequence[int], blocks: Any) -> PutResult:
        w = self._writes
        rows = block_rows(blocks, len(positions), w.block_bytes, dtypes=w.dtypes)
        return w.copy(self._keys_at(self._take(positions)), rows)

    def put_in_place(self, positions: Sequence[int], fill: Fill) -> PutResult:
        taken = self._take(positions)
        return self._writes.fill(self._keys_at(taken), taken, fill, self.top_held)

    def skipping(self, result: PutResult) -> PutResult:
        """``result`` with this plan's skipped keys counted in: a whole put's answer."""
        return PutResult(result.stored, result.skipped + self.skipped, result.rejected)

    def _keys_at(self, positions: list[int]) -> list[bytes]:
        # ``fresh`` is ascending: all of the batch's positions, it is the batch itself (no list to build).
        if positions is self.fresh and len(positions) == len(self.keys):
            return self.keys
        return [self.keys[i] for i in positions]

    def _take(self, positions: Sequence[int]) -> list[int]:
        if self._claimed is None:
            if positions is self.fresh:  # a whole put in one write (the common case): nothing to check
                self._claimed = set()
                return self.fresh
            self._claimed = set(self.fresh)
        taken = list(positions)
        if len(set(taken)) != len(taken) or not self._claimed.issuperset(taken):
            raise ValueError("a PutPlan writes only its fresh positions, each once")
        self._claimed.difference_update(taken)
        return taken


__all__ = ["PutPlan", "TopWrites"]
