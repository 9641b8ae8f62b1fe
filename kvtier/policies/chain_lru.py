"""Chain-aware LRU: LRU in which the keys of one put or one hit are ordered by depth, the tail oldest.

Arrivals (observations.py) tell the policy each key's depth in its chain; a put or a hit of several keys then
makes them the most recent with the deepest ones oldest among them, so a prefix loses its tail before its root
whatever order the batch lists them in (vLLM saves and looks up root first, the replay tail first: with the
replay's order it is exactly LRU). Keys without a known depth keep their batch order, as LRU; ``admit`` orders
a put's new keys root-most first, so a tier short of victims refuses the tail. It admits every block and
ignores agents, stop reasons and hints. (An arrival does not refresh its chain: on agentic-cc at DRAM 5% that
lost a point against LRU, keeping blocks the engine's HBM already serves.)

Memory: per tracked key an order entry and its depth; per key of a recent chain not stored yet one pending
entry (``max_pending``, oldest dropped first); per recent request its chain length (``max_requests``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Container, Sequence
from itertools import compress, repeat
from operator import gt, lt, not_

from kvtier.policies.base import Clock, Policy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.observations import Observations
from kvtier.policies.registry import register_policy


@register_policy("chain-lru")
class ChainLRUPolicy(Policy):
    name = "chain-lru"
    observes = True

    def __init__(self, capacity: int = 0, *, clock: Clock = time.monotonic, max_pending: int | None = None,
                 max_requests: int = 1 << 14) -> None:
        super().__init__(capacity, clock=clock)
        self._lru = LRUPolicy(capacity, clock=clock)
        self._order = self._lru._order  # oldest first
        self._depth: dict[bytes, int] = {}
        self._pending: OrderedDict[bytes, int] = OrderedDict()
        self._chains: OrderedDict[str, int] = OrderedDict()
        self.max_pending = max_pending if max_pending is not None else max(capacity, 1 << 16)
        self.max_requests = max_requests

    def observe(self, batch: Observations) -> None:
        for a in batch.arrivals:
            self._learn(a.keys, 0)
            self._chains[a.request] = len(a.keys)
            self._chains.move_to_end(a.request)
            while len(self._chains) > self.max_requests:
                self._chains.popitem(last=False)
        for c in batch.completions:
            if c.keys and c.request in self._chains:
                self._learn(c.keys, self._chains[c.request])

    def _learn(self, keys: Sequence[bytes], start: int) -> None:
        """Remember the depths of the chain's keys not tracked yet (their insert comes); looped in C."""
        pending = self._pending
        untracked = list(compress(range(start, start + len(keys)), map(not_, map(self._order.__contains__, keys))))
        pending.update(zip([keys[d - start] for d in untracked], untracked))
        while len(pending) > self.max_pending:
            pending.popitem(last=False)

    def insert(self, keys: Sequence[bytes]) -> None:
        pop = self._pending.pop
        self.insert_at(keys, [pop(k, -1) for k in keys])

    def insert_at(self, keys: Sequence[bytes], depths: Sequence[int]) -> None:
        """insert, with each key's depth given (-1: not known; no depths at all: none known) instead of
        learned from arrivals (a policy that keeps this order beside its own knows the depths already)."""
        if not depths:
            self._lru.insert(keys)
            return
        known = [k for k, d in zip(keys, depths) if d >= 0]
        if known:
            self._depth.update(zip(known, [d for d in depths if d >= 0]))
        self._lru.insert(_tail_first(keys, depths))

    def access(self, keys: Sequence[bytes]) -> None:
        if not self._depth:  # no depth known (a store told nothing): LRU
            self._lru.access(keys)
            return
        self._lru.access(_tail_first(keys, list(map(self._depth.get, keys, repeat(-1)))))

    def remove(self, keys: Sequence[bytes]) -> None:
        self._lru.remove(keys)
        if self._depth:
            deque(map(self._depth.pop, keys, repeat(None)), maxlen=0)

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        out = self._lru.victims(n, protected)
        pop = self._depth.pop
        for k in out:
            pop(k, None)
        return out

    def admit(self, keys: Sequence[bytes], free: int) -> Sequence[int] | None:
        get = self._pending.get
        depths = [get(k, -1) for k in keys]
        if max(depths, default=-1) < 0:
            return None
        known = sorted((d, i) for i, d in enumerate(depths) if d >= 0)
        return [i for _, i in known] + [i for i, d in enumerate(depths) if d < 0]

    def keys(self) -> list[bytes]:
        """Tracked keys, least recently used first."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)


def _tail_first(keys: Sequence[bytes], depths: Sequence[int]) -> Sequence[bytes]:
    """``keys`` made most recent in this order: unknown depths first (batch order), then deepest first. A
    batch listed tail first or root first (the usual cases) is recognised without a sort."""
    if len(keys) < 2:
        return keys
    if min(depths) >= 0:
        if all(map(gt, depths, depths[1:])):
            return keys
        if all(map(lt, depths, depths[1:])):
            return keys[::-1]
        return [k for _, k in sorted(zip(depths, keys), reverse=True)]
    unknown = [k for k, d in zip(keys, depths) if d < 0]
    known = sorted(((d, k) for k, d in zip(keys, depths) if d >= 0), reverse=True)
    return unknown + [k for _, k in known]
