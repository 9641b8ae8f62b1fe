"""Which checkpoints of a hybrid model survive below HBM: the session-aware rule for recurrent states and
sliding-window tails (issue 24, item 3).

A hybrid model's prefix can be restored only at a checkpoint: a block boundary where the engine kept the
recurrent (Mamba / GatedDeltaNet) state and the window before it (the end of each turn's prompt, a prefix a
second agent shared, every retention interval). Unlike a full-attention chain, whose root blocks serve every
later turn, a checkpoint serves only hits at its own position, so deepest-first eviction is wrong for it: an
agent's next turn extends its newest checkpoint, and the older ones are dead weight. The rule:

1. a checkpoint superseded by a newer one of the same agent goes first (unless another live agent saw it too);
2. then the checkpoints no live agent saw (finished agents, or agents the policy does not expect back);
3. then the rest, the agent predicted back last first; a fork junction (seen by several agents) counts as
   back when the soonest of its live agents is, so it is kept while any of them is alive.

``CheckpointRule`` holds what it was told of checkpoints (``add``) and answers an eviction order for given keys
(``order``) from the caller's view of agents (alive, predicted back at); it moves no block. The session-aware
policy (pnu.py) is the caller, for the keys an arrival marks as checkpoints. Bounded memory: at most
``max_checkpoints`` entries, the oldest forgotten first (a forgotten checkpoint is ordered as no live agent's),
each with at most ``MAX_AGENTS`` agents (a junction every conversation passes, such as a shared system prompt's,
would otherwise gather them all: past the bound an arbitrary one of them is forgotten).
Not thread-safe (a policy runs under its tier's lock).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

SUPERSEDED, UNSEEN, LIVE = 0, 1, 2  # eviction classes, evicted in this order
MAX_AGENTS = 64  # agents remembered per checkpoint


@dataclass
class Checkpoint:
    position: int  # tokens before the boundary
    agents: set[str] = field(default_factory=set)  # agents whose requests reached it (2+: a fork junction)


class CheckpointRule:
    """See the module docstring."""

    def __init__(self, max_checkpoints: int = 1 << 16) -> None:
        if max_checkpoints < 1:
            raise ValueError(f"max_checkpoints must be >= 1, got {max_checkpoints}")
        self.max_checkpoints = max_checkpoints
        self._points: OrderedDict[bytes, Checkpoint] = OrderedDict()
        self._newest: dict[str, int] = {}  # agent -> position of its newest checkpoint

    def add(self, key: bytes, agent: str, position: int) -> None:
        """Agent ``agent``'s request reached checkpoint ``key`` at ``position`` tokens (a second agent's: a junction)."""
        point = self._points.pop(key, None) or Checkpoint(position)
        if agent not in point.agents and len(point.agents) >= MAX_AGENTS:
            point.agents.pop()
        point.agents.add(agent)
        self._points[key] = point
        self._newest[agent] = max(self._newest.get(agent, -1), position)
        while len(self._points) > self.max_checkpoints:
            self._points.popitem(last=False)

    def forget(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._points.pop(k, None)

    def __len__(self) -> int:
        return len(self._points)

    def eviction_class(self, key: bytes, alive: Container[str]) -> int:
        point = self._points.get(key)
        if point is None:
            return UNSEEN
        live = [a for a in point.agents if a in alive]
        if not live:
            return UNSEEN
        if len(point.agents) == 1 and self._newest[live[0]] > point.position:
            return SUPERSEDED
        return LIVE

    def order(self, keys: Sequence[bytes], alive: Container[str], back_at: Callable[[str], float]) -> list[bytes]:
        """``keys`` in eviction order, the first to go first. ``alive``: agents the caller still expects;
        ``back_at(agent)``: when it is predicted back (inf: not known)."""

        def rank(key: bytes) -> tuple[int, float, int]:
            cls = self.eviction_class(key, alive)
            point = self._points.get(key)
            if cls != LIVE or point is None:
                return (cls, 0.0, point.position if point is not None else 0)
            soonest = min((back_at(a) for a in point.agents if a in alive), default=math.inf)
            return (LIVE, -soonest, point.position)  # back last first; a tie: the older position first

        return sorted(keys, key=rank)


class CheckpointObjects:
    """The store keys of each checkpoint (its objects: a state, window blocks) and the rule over them, as a
    policy learns them from arrivals (``Arrival.checkpoints``). A checkpoint is named by its first object's key;
    an object shared by several checkpoints (overlapping window tails) belongs to the one declared last.
    Bounded: ``max_checkpoints`` checkpoints (the oldest forgotten first, with their objects) and as many agents'
    lists of their checkpoints not yet superseded, the newest ``MAX_AGENTS`` of each."""

    def __init__(self, max_checkpoints: int = 1 << 16) -> None:
        self.rule = CheckpointRule(max_checkpoints)
        self._objects: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()  # checkpoint -> its objects
        self._of: dict[bytes, bytes] = {}  # object key -> its checkpoint
        self._by_agent: OrderedDict[str, list[bytes]] = OrderedDict()  # agent -> checkpoints not superseded

    def add(self, agent: str, position: int, objects: Sequence[bytes], sharers: Iterable[str] = ()) -> bytes:
        """Agent ``agent`` reached the checkpoint of ``objects`` at ``position``; ``sharers``: other agents
        that saw its prefix (a fork junction). Returns the checkpoint's name."""
        cid = objects[0]
        for a in (agent, *sharers):
            self.rule.add(cid, a, position)
            mine = self._by_agent.pop(a, None) or []
            if cid not in mine:
                mine.append(cid)
                del mine[:-MAX_AGENTS]  # junctions stay listed; the oldest beyond the bound are not re-checked
            self._by_agent[a] = mine
        self._objects.pop(cid, None)
        self._objects[cid] = tuple(objects)
        self._of.update(dict.fromkeys(objects, cid))
        while len(self._objects) > self.rule.max_checkpoints:
            self._drop(*self._objects.popitem(last=False))
        while len(self._by_agent) > self.rule.max_checkpoints:
            self._by_agent.popitem(last=False)
        return cid

    def _drop(self, cid: bytes, objects: tuple[bytes, ...]) -> None:
        for k in objects:
            if self._of.get(k) == cid:
                del self._of[k]

    def of(self, key: bytes) -> bytes | None:
        """The checkpoint ``key`` is an object of (None: not a checkpoint's object, or forgotten)."""
        return self._of.get(key)

    def objects(self, cid: bytes) -> list[bytes]:
        """The objects that belong to checkpoint ``cid`` now."""
        return [k for k in self._objects.get(cid, ()) if self._of.get(k) == cid]

    def agents(self, cid: bytes) -> set[str]:
        point = self.rule._points.get(cid)
        return point.agents if point is not None else set()

    def superseded(self, agent: str, alive: Container[str]) -> list[bytes]:
        """The objects of ``agent``'s checkpoints its newer one superseded (each reported once)."""
        mine = self._by_agent.get(agent)
        if not mine:
            return []
        out: list[bytes] = []
        keep = []
        for cid in mine:
            cls = self.rule.eviction_class(cid, alive)
            if cls == SUPERSEDED:
                out += self.objects(cid)
            elif cid in self._objects:
                keep.append(cid)
        self._by_agent[agent] = keep
        return out
