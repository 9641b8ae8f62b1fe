"""Placement policies for ``route_put``: which node (and tier) should store each new block.

A policy sees the live nodes with their free bytes per tier (capacity - used from the last heartbeat - what
earlier route_puts already sent there) and picks, per block, a node and the first of its tiers with room.
Built in:

* ``most_available``: the node with the most free bytes, block by block (spreads load, fills evenly);
* ``local_first``: the requester itself while it has room, then most_available (no network for the put);
* ``rendezvous``: highest-random-weight hashing of each key over the nodes with room (stable placement
  without coordination: a node joining or leaving moves only its share of keys). Needs the keys.

A policy is a class with ``place(blocks) -> list[(node, tier) | None]``, registered by name with
``@register_placement("name")`` or loaded by import path ``"package.module:Class"``.
Runs in the master's event loop; policies are called with state they must not keep.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtier.keys import rendezvous_order
from kvtier.master.nodes import Node
from kvtier.registry import ClassRegistry


@dataclass
class PlacementRequest:
    """Blocks to place: ``sizes`` in bytes, their ``keys`` ((n, 2) uint64) when the caller sent them, and the
    node asking (``requester``, may be None or a node the master does not know)."""

    sizes: np.ndarray
    keys: np.ndarray | None
    requester: str | None


class PlacementError(ValueError):
    """The request cannot be placed by this policy (e.g. rendezvous without keys)."""


class PlacementPolicy(Protocol):
    def place(self, req: PlacementRequest, nodes: list[Node]) -> list[tuple[str, str] | None]:
        """Per block, (node id, tier) or None where no live node has room. Must not change ``nodes``."""


_PLACEMENTS = ClassRegistry("placement policy")


def register_placement(name: str) -> Callable[[type], type]:
    """Class decorator: make a placement policy available under ``name``."""
    return _PLACEMENTS.register(name)


def known_placements() -> list[str]:
    return _PLACEMENTS.names()


def make_placement(spec: str) -> PlacementPolicy:
    """A policy by registered name or import path ('package.module:Class')."""
    return _PLACEMENTS.get(spec)()


class _Room:
    """Free bytes per (node, tier) during one placement, decremented as blocks are assigned. A kvtier-pool
    (label role=pool) evicts by its own policy to take new blocks, so a full one still has room: its capacity
    less what was sent there since its last heartbeat (a full pool would otherwise never get a block again)."""

    def __init__(self, nodes: list[Node]) -> None:
        self.free = {n.node_id: {t.name: max(0, t.capacity - t.promised) if n.labels.get("role") == "pool"
                                 else t.free for t in n.tiers.values()} for n in nodes}

    def take(self, node: str, size: int) -> str | None:
        """The first tier of ``node`` with room for ``size`` bytes (now taken), or None."""
        for tier, free in self.free.get(node, {}).items():
            if free >= size:
                self.free[node][tier] = free - size
                return tier
        return None

    def total(self, node: str) -> int:
        return sum(self.free[node].values())


@register_placement("most_available")
class MostAvailable:
    """Each block to the node with the most free bytes (over its tiers) that can hold it."""

    def place(self, req: PlacementRequest, nodes: list[Node]) -> list[tuple[str, str] | None]:
        room = _Room(nodes)
        heap = [(-room.total(n.node_id), n.node_id) for n in nodes]
        heapq.heapify(heap)
        out: list[tuple[str, str] | None] = []
        for size in req.sizes.tolist():
            skipped = []
            target = None
            while heap:
                neg, node = heapq.heappop(heap)
                tier = room.take(node, size)
                if tier is not None:
                    target = (node, tier)
                    heapq.heappush(heap, (-room.total(node), node))
                    break
                skipped.append((neg, node))
            for item in skipped:  # full for this block, maybe not for a smaller one
                heapq.heappush(heap, item)
            out.append(target)
        return out


@register_placement("local_first")
class LocalFirst:
    """The requester while it has room, the most available node after that."""

    def place(self, req: PlacementRequest, nodes: list[Node]) -> list[tuple[str, str] | None]:
        local = [n for n in nodes if n.node_id == req.requester]
        if not local:
            return MostAvailable().place(req, nodes)
        room = _Room(local)
        out: list[tuple[str, str] | None] = []
        spill = []
        for i, size in enumerate(req.sizes.tolist()):
            tier = room.take(local[0].node_id, size)
            out.append((local[0].node_id, tier) if tier else None)
            if tier is None:
                spill.append(i)
        if spill:
            others = [n for n in nodes if n.node_id != req.requester]
            rest = PlacementRequest(req.sizes[spill], None if req.keys is None else req.keys[spill], req.requester)
            for i, target in zip(spill, MostAvailable().place(rest, others)):
                out[i] = target
        return out


@register_placement("rendezvous")
class Rendezvous:
    """Highest-random-weight hashing of each key over the nodes (the next-ranked node where one is full)."""

    def place(self, req: PlacementRequest, nodes: list[Node]) -> list[tuple[str, str] | None]:
        if req.keys is None:
            raise PlacementError("placement policy 'rendezvous' needs the blocks' keys (send 'keys')")
        if not nodes:
            return [None] * len(req.sizes)
        ranking = rendezvous_order(req.keys, [n.node_id for n in nodes])  # highest weight first
        room = _Room(nodes)
        out: list[tuple[str, str] | None] = []
        for size, order in zip(req.sizes.tolist(), ranking.tolist()):
            target = None
            for j in order:
                tier = room.take(nodes[j].node_id, size)
                if tier is not None:
                    target = (nodes[j].node_id, tier)
                    break
            out.append(target)
        return out

