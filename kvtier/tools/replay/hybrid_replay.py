"""HybridCache: one request of a hybrid model through HBM and the store, storing only what can be used.

The store holds three kinds of objects, each a run of store slots (``units``) of ``unit_bytes`` each (the
full-history groups' bytes of one block, so a full-history block is one slot and the others round to whole
slots; the rounding is reported):

* a full-history block: the request's block key itself (the uniform replay's key, so the chain is the same);
* a window group's block: ``units`` keys derived from the block's key and the group;
* the recurrent state at a boundary: ``units`` keys derived from the key of the block before it.

A request's hit is the deepest boundary ``restorable_depth`` allows with what HBM and the store hold, looked
for among the boundaries that may be restorable (an index kept here, as the engine knows where it left
checkpoints: a checkpoint's boundary, and for a model without recurrent state any boundary a stored window tail
covers; presence is always asked of HBM and the store). What the request's prefill computes is stored
write-through: its full-history blocks, and at each new checkpoint (hybrid.checkpoints) the state and each
window group's tail. Derived keys are xxh3-128 of the block key and a tag, so they never meet a block key.

Bytes stored and loaded are counted exactly, per group; ``whole_bytes_stored`` is what storing every group of
every stored block whole (one packed block) would have written for the same blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvtier.policies import Arrival
from kvtier.tools.replay.hbm import HbmPrefixCache
from kvtier.tools.replay.hybrid import STATE, HybridModel, boundary_objects, checkpoints, restorable_depth
from kvtier.store import TieredStore

if TYPE_CHECKING:
    from kvtier.tools.replay.replayer import ReplayResult

STATE_NAME = "state"  # the recurrent state's name among the groups in the report
FULL = "full"


@dataclass(frozen=True)
class Objects:
    """How many store slots each kind of object takes, and the bytes it really holds."""

    unit_bytes: int
    window_units: tuple[int, ...]
    window_bytes: tuple[int, ...]
    tails: tuple[int, ...]
    state_units: int
    whole_block_bytes: int

    @classmethod
    def of(cls, model: HybridModel, block_tokens: int) -> Objects:
        unit = model.full_block_bytes(block_tokens)
        wbytes = tuple(model.window_block_bytes(g, block_tokens) for g in model.windows)
        return cls(unit, tuple(max(1, round(b / unit)) for b in wbytes), wbytes,
                   tuple(g.tail_blocks(block_tokens) for g in model.windows),
                   max(1, round(model.state_bytes / unit)) if model.state_bytes else 0,
                   model.layout(block_tokens).nbytes)

    def rounding(self, model: HybridModel) -> float:
        """The largest relative error of an object's room in slots against its real bytes."""
        errs = [abs(u * self.unit_bytes - b) / b for u, b in zip(self.window_units, self.window_bytes)]
        if model.state_bytes:
            errs.append(abs(self.state_units * self.unit_bytes - model.state_bytes) / model.state_bytes)
        return max(errs, default=0.0)


def _derived(key: bytes, tag: bytes, units: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(key + tag + i.to_bytes(2, "little")) for i in range(units)]


class HybridCache:
    """Serves requests of one replay (single-threaded). ``result`` is the ReplayResult it adds to."""

    def __init__(self, model: HybridModel, block_tokens: int, store: TieredStore | None, hbm: HbmPrefixCache,
                 unique_blocks: int, bandwidth: dict[str, float], result: ReplayResult) -> None:
        self.model, self.bt, self.store, self.hbm = model, block_tokens, store, hbm
        self.obj = Objects.of(model, block_tokens)
        self.interval = model.interval_tokens // block_tokens
        self._bandwidth = bandwidth
        self.result = result
        self._seen = np.zeros(max(unique_blocks, 1), bool)  # global ids some request has had in its prompt
        # Boundaries that may be restorable, by the global id of the block before them: a checkpoint's; for a
        # model without recurrent state also every boundary whose previous block a stored window tail covers
        # (its window may be whole there: vLLM hits a sliding-window group at any block its window holds).
        self._candidates = np.zeros(max(unique_blocks, 1), bool)
        self._min_tail = min((t for t in self.obj.tails if t), default=1)  # a tail of 0 needs nothing
        self._rows = np.zeros((0, store.block_bytes if store else 1), np.uint8)
        self._put_limit = store.capacity_blocks if store else 0
        res = self.result
        groups = [FULL, *(g.name for g in model.windows), *([STATE_NAME] if model.recurrent else [])]
        res.group_bytes_stored = dict.fromkeys(groups, 0)
        res.group_bytes_loaded = dict.fromkeys(groups, 0)

    # ---- the objects at a boundary ---------------------------------------------------------------------

    def _objects(self, keys: list[bytes], d: int) -> list[tuple[str, int, list[bytes]]]:
        """(group, real bytes, slot keys) of each object restoring at boundary ``d`` needs besides the
        full-history blocks (hybrid.boundary_objects)."""
        return self._keyed(keys, boundary_objects(d, self.obj.tails, self.model.recurrent))

    def _keyed(self, keys: list[bytes], objects: list[tuple[int, int]]) -> list[tuple[str, int, list[bytes]]]:
        out = []
        for g, i in objects:
            if g == STATE:  # the state at boundary i follows block i - 1
                state = _derived(keys[i - 1], b"state", self.obj.state_units)
                out.append((STATE_NAME, self.model.state_bytes, state))
            else:
                out.append((self.model.windows[g].name, self.obj.window_bytes[g],
                            _derived(keys[i], b"w" + g.to_bytes(1, "little"), self.obj.window_units[g])))
        return out

    def boundary_keys(self, keys: list[bytes], d: int) -> list[bytes]:
        """The store keys of every object restoring at boundary ``d`` needs besides the full-history blocks."""
        return [k for _, _, ks in self._objects(keys, d) for k in ks]

    def _deepest(self, keys: list[bytes], gids: np.ndarray, full_prefix: int,
                 held: Callable[[list[bytes]], bool]) -> int:
        """The deepest boundary every group can be restored at (hybrid.restorable_depth), among the candidates,
        with what ``held`` says is there."""
        cands = np.flatnonzero(self._candidates[gids[:full_prefix]]) + 1  # boundary d follows block d - 1
        return restorable_depth(full_prefix, cands.tolist(), self.obj.tails, self.model.recurrent,
                                lambda objs: held([k for _, _, ks in self._keyed(keys, objs) for k in ks]))

    # ---- one request -----------------------------------------------------------------------------------

    def serve(self, keys: list[bytes], gids: np.ndarray, arrival: Arrival) -> tuple[int, int, float]:
        """(HBM blocks, store blocks, load seconds) of one request arriving with block ``keys`` (global ids
        ``gids``); stores what its prefill computes and admits it all to HBM. The store observes ``arrival``
        with the checkpoints the request restores from and makes, once its lookup knows them (an engine knows
        the one it loads after its lookup and the ones it saves before its puts)."""
        n, hbm, store = len(keys), self.hbm, self.store
        res = self.result
        junction = int(np.argmin(self._seen[gids])) if not self._seen[gids].all() else n
        self._seen[gids] = True
        fh = hbm.prefix(keys)
        h = self._deepest(keys, gids, fh, lambda ks: all(k in hbm for k in ks))
        d, load_s = h, 0.0
        if store is not None and fh < n:
            f_all = fh + store.lookup_prefix(keys[fh:]).length
        else:
            f_all = fh
        if store is not None and f_all > h:
            def held(ks: list[bytes]) -> bool:
                rest = [k for k in ks if k not in hbm]
                return not rest or all(store.contains(rest))

            d = self._deepest(keys, gids, f_all, held)
        if d > h:
            d, load_s = self._load(keys, fh, h, d)
        new = checkpoints(n, d, junction, self.interval)
        if store is not None:
            reached = [d] if d else []
            store.observe(arrivals=[replace(arrival, checkpoints=[(c, self.boundary_keys(keys, c))
                                                                  for c in reached + new])])
        made: list[bytes] = []
        for c in new:
            made += self.boundary_keys(keys, c)
            if self.model.recurrent:
                self._candidates[gids[c - 1]] = True
            else:
                self._candidates[gids[max(0, c - self._min_tail):c]] = True
        if store is not None:
            self._store(keys, d, new)
        # HBM: what the request used or made, its checkpoints' objects most recent (they make its blocks
        # usable); write-through has stored everything below HBM already, so the victims are dropped.
        if n:
            hbm.admit(made[::-1] + self.boundary_keys(keys, d)[::-1] + keys)
        return h, d - h, load_s

    def _load(self, keys: list[bytes], fh: int, h: int, d: int) -> tuple[int, float]:
        """Read what restoring at ``d`` needs and HBM lacks (the full-history blocks past HBM's ``fh``, the
        boundary's objects) from the store: (the boundary restored, load seconds). The hit's tokens past HBM's
        boundary ``h`` are credited to the tiers in proportion to the slots each served; a slot gone between
        the lookup and the get makes it a miss back to ``h``."""
        store, hbm, res = self.store, self.hbm, self.result
        assert store is not None
        loaded = keys[fh:d]
        loaded_bytes = {FULL: max(d - fh, 0) * self.obj.unit_bytes}
        for name, nbytes, ks in self._objects(keys, d):
            missing = [k for k in ks if k not in hbm]
            loaded += missing
            loaded_bytes[name] = loaded_bytes.get(name, 0) + nbytes * len(missing) // len(ks)
        found = store.lookup_prefix(loaded)
        got = store.get(loaded, self._buffer(len(loaded))) if found.length == len(loaded) else []
        if not got or not all(got):
            res.lost_blocks += max(d - h, 1)
            return h, 0.0
        per_tier: dict[str, int] = {}
        for tier, count in found.runs:
            per_tier[tier] = per_tier.get(tier, 0) + count
        load_s, credited = 0.0, 0
        for tier, count in per_tier.items():
            load_s += count * self.obj.unit_bytes / self._bandwidth[tier]
            share = (d - h) * self.bt * count // len(loaded)
            res.hit_tokens[tier] += share
            credited += share
        res.hit_tokens[found.runs[-1][0]] += (d - h) * self.bt - credited  # the rounding remainder
        for name, b in loaded_bytes.items():
            res.group_bytes_loaded[name] += b
        return d, load_s

    def _store(self, keys: list[bytes], d: int, new: list[int]) -> None:
        """Write-through: the computed full-history blocks (tail first, as the uniform replay does), then the
        new checkpoints' objects; count what the store did not hold before."""
        res = self.result
        computed = keys[d:]
        fresh = self._put(computed[::-1])
        res.group_bytes_stored[FULL] += fresh * self.obj.unit_bytes
        res.whole_bytes_stored += fresh * self.obj.whole_block_bytes
        for c in new:  # a share of an object's slots new (the rest held already): that share of its bytes
            for name, nbytes, ks in self._objects(keys, c):
                res.group_bytes_stored[name] += self._put(ks) * nbytes // len(ks)

    def _put(self, keys: list[bytes]) -> int:
        """Store ``keys`` (in batches the top tier can hold); how many were new."""
        stored = 0
        for start in range(0, len(keys), self._put_limit or 1):
            batch = keys[start:start + (self._put_limit or 1)]
            stored += self.store.put(batch, self._buffer(len(batch))).stored  # type: ignore[union-attr]
        return stored

    def _buffer(self, n: int) -> np.ndarray:
        if len(self._rows) < n:
            self._rows = np.zeros((max(n, 2 * len(self._rows)), self._rows.shape[1]), np.uint8)
        return self._rows[:n]
