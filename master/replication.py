"""Replicas: which holder of a key ``locate`` names, and hot-block replication between pools (off by default).

**Choosing among holders.** A key several live nodes hold is answered with one of them by weighted
rendezvous hashing: each (key, holder) gets a stable pseudo-random score, divided by the holder's measured
bandwidth out of that tier (the EWMA nodes report; it falls when a pool is loaded), and the best wins. So each
key's choice is stable (clients hit the same pool's cache), load spreads over replicas in proportion to what
they serve, and a holder's death moves only its share. Same answer on every master: the scores depend on the
key, the node id and the tier, never on this master's location numbers.

**Hot-block replication** (``--replicate-heat H``; 0, the default, is off): every ``--replicate-interval-s``
the master looks at the hottest keys (``top``); one whose heat is at least H and that exactly one live pool
(label role=pool) holds gets a copy on another pool: the rendezvous-first other pool with room. The work goes
to that pool in its next heartbeat reply ("copy these keys from pool X"): the pool copies them pool to pool
over the pools' own client transports (pool/replicas.py) and reports them as any block it stores, so the directory
then names two holders. A replica whose heat falls below H/2 (hysteresis) is dropped again: every pool
holding the key but the first by node id is asked to remove it. A pool that dies takes only its bits with it:
the other replica is still a live holder, so ``locate`` and ``cost`` go on naming it.

Work is bounded: at most ``MAX_KEYS_PER_ROUND`` keys asked per round, and a key asked about is not asked again
for three intervals. Masters sharing a directory each plan from their view; the target of a key is a
function of the key and the live pools, so they ask for the same copies, and a pool gets its work from
whichever master answers its heartbeats. Runs on the master's event loop.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvtier.keys import rendezvous_order
from kvtier.master.directory import WORD_BITS, location_words, mask_locations
from kvtier.wire.pool import POOL_LABELS

if TYPE_CHECKING:
    from kvtier.master.service import MasterState

log = logging.getLogger(__name__)
MAX_KEYS_PER_ROUND = 4096
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a stable 64-bit hash of each word."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _several(masks: np.ndarray) -> np.ndarray:
    """Per row of location masks (one key's placements), whether more than one bit is set: several holders."""
    return ((masks != 0).sum(axis=1) > 1) | ((masks & (masks - np.uint64(1))) != 0).any(axis=1)


def choose_holders(st: MasterState, keys: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Per key, the location ``locate`` names (-1: none), from its live placements ``masks`` (see the doc)."""
    nonzero = masks != 0
    held = nonzero.any(axis=1)
    word = nonzero.argmax(axis=1)
    bits = masks[np.arange(len(masks)), word]
    lowest = bits & (~bits + np.uint64(1))
    locs = np.where(held, word * WORD_BITS + np.log2(np.maximum(lowest, 1).astype(np.float64)).astype(np.int64), -1)
    rows = np.flatnonzero(_several(masks))
    if rows.size == 0:
        return locs
    used = mask_locations(np.bitwise_or.reduce(masks[rows], axis=0))
    owners = [st.registry.owner(u) for u in used]
    salts = np.array([xxhash.xxh3_64_intdigest(f"{o[0]}\0{o[1]}".encode()) if o else 0 for o in owners], np.uint64)
    weights = np.array([st.cost.tier_bw(st.registry.nodes[o[0]], o[1]) if o else 0.0 for o in owners])
    has = np.stack([((masks[rows, u // WORD_BITS] >> np.uint64(u % WORD_BITS)) & np.uint64(1)).astype(bool)
                    for u in used], axis=1)
    k = keys[rows]
    h = _mix(_mix(k[:, 0] ^ _mix(k[:, 1]))[:, None] ^ salts[None, :])
    uniform = ((h >> np.uint64(11)).astype(np.float64) + 1.0) / float(1 << 53)  # (0, 1]
    score = -np.log(uniform) / np.maximum(weights[None, :], 1e-9)
    score[~has | (weights[None, :] <= 0)] = np.inf
    locs[rows] = np.asarray(used, np.int64)[score.argmin(axis=1)]
    return locs


class Replicator:
    """Plans copies of hot keys held by one pool and drops of cold replicas; hands each pool its share."""

    def __init__(self, threshold: float, interval_s: float) -> None:
        self.threshold = threshold
        self.interval_s = interval_s
        self._next = 0.0
        self._asked: dict[bytes, float] = {}  # key -> when it was last asked about (copy or drop)
        self._copies: dict[str, list[list[Any]]] = defaultdict(list)  # target -> [[source, address, keys], ...]
        self._drops: dict[str, list[bytes]] = defaultdict(list)  # pool -> keys to remove
        self.counters = {"copies_planned": 0, "drops_planned": 0, "rounds": 0}

    def work_for(self, node_id: str) -> dict[str, Any]:
        """What the pool ``node_id`` is asked to do, taken (its heartbeat reply carries it)."""
        out: dict[str, Any] = {}
        copies = self._copies.pop(node_id, None)
        if copies:
            out["replicate"] = [[src, addr, b"".join(keys)] for src, addr, keys in copies]
        drops = self._drops.pop(node_id, None)
        if drops:
            out["drop"] = b"".join(drops)
        return out

    def tick(self, st: MasterState, now: float) -> None:
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.counters["rounds"] += 1
        self._asked = {k: t for k, t in self._asked.items() if now - t < 3 * self.interval_s}
        pools = [n for n in st.registry.live_nodes() if all(n.labels.get(k) == v for k, v in POOL_LABELS.items())]
        if len(pools) < 2:
            return
        live = st.live_mask()
        pool_mask = location_words([loc for n in pools for loc in n.locations.values()], len(live)) & live
        self._plan_copies(st, pools, pool_mask, now)
        self._plan_drops(st, pool_mask, now)

    def _plan_copies(self, st: MasterState, pools: list[Any], pool_mask: np.ndarray, now: float) -> None:
        keys, heat, _count, _last = st.directory.top(MAX_KEYS_PER_ROUND, st.wall())
        keys = keys[heat >= self.threshold]
        if not len(keys):
            return
        _, masks = st.directory.masks(keys, pool_mask)
        rows = np.flatnonzero((masks != 0).any(axis=1) & ~_several(masks))  # exactly one holder
        if not rows.size:
            return
        names = [n.node_id for n in pools]
        by_name = {n.node_id: n for n in pools}
        order = rendezvous_order(keys[rows], names)
        raw = np.ascontiguousarray(keys[rows]).tobytes()
        block = st.directory.block_bytes(st.directory.table.find(keys[rows]))
        room = {n.node_id: sum(t.free for t in n.tiers.values()) for n in pools}
        for j, r in enumerate(rows.tolist()):
            key = raw[16 * j : 16 * j + 16]
            if key in self._asked:
                continue
            owner = st.registry.owner(mask_locations(masks[r])[0])
            if owner is None:
                continue
            for idx in order[j].tolist():
                target = names[idx]
                if target != owner[0] and room[target] >= block[j]:
                    room[target] -= int(block[j])
                    self._add_copy(target, owner[0], by_name[owner[0]].address, key)
                    self._asked[key] = now
                    self.counters["copies_planned"] += 1
                    break

    def _add_copy(self, target: str, source: str, address: str, key: bytes) -> None:
        tasks = self._copies[target]
        for task in tasks:
            if task[0] == source:
                task[2].append(key)
                return
        tasks.append([source, address, [key]])

    def _plan_drops(self, st: MasterState, pool_mask: np.ndarray, now: float) -> None:
        d = st.directory
        slots = d.table.live_slots()
        if not slots.size:
            return
        m = d.table.column("mask")[slots] & pool_mask
        several = _several(m)
        slots, m = slots[several], m[several]
        if not slots.size:
            return
        _, heat, _ = d.heat(np.stack([d.table.k0[slots], d.table.k1[slots]], axis=1), st.wall())
        cold = np.flatnonzero(heat < self.threshold / 2)[:MAX_KEYS_PER_ROUND]
        for r in cold.tolist():
            slot = int(slots[r])
            key = np.array([[d.table.k0[slot], d.table.k1[slot]]], np.uint64).tobytes()
            if key in self._asked:
                continue
            holders = sorted({o[0] for o in map(st.registry.owner, mask_locations(m[r])) if o is not None})
            for pool in holders[1:]:
                self._drops[pool].append(key)
                self.counters["drops_planned"] += 1
            self._asked[key] = now
