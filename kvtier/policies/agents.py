"""Agent records and their eviction order, for the session-aware policy (pnu.py).

``Agent``: what is known of one agent (its requests' times, its last stop reason, its hints) and which tracked
keys are its own (a heap by depth, deepest first, with stale entries dropped lazily). ``Ranking``: the agents
holding keys, sorted by the policy's eviction key (the largest goes first): re-scored in full at most once per
``refresh_s`` of the clock (a prediction moves with time), and in between only the agents an observation or a
first key changed are moved, by bisection. Not thread-safe (the policy runs under its tier's lock).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable

from kvtier.policies.returns import Outcome

INF = math.inf
UNKNOWN_STOP = "unknown"

Key = tuple[float, float, float, int]  # (-priority, predicted back at, -last active, uid)


class Agent:
    """One agent's state. ``heap``: (-depth, key) of its tracked keys, stale entries left for lazy deletion
    (a key is the agent's while the policy's ``where[key] is agent``)."""

    __slots__ = ("name", "uid", "heap", "count", "arrived", "completed", "stop", "inflight", "finished",
                 "waiting", "ttl_until", "priority", "last", "rank", "alive", "outcome")

    def __init__(self, name: str, uid: int, now: float) -> None:
        self.name, self.uid = name, uid
        self.heap: list[tuple[int, bytes]] = []
        self.count = 0
        self.arrived = self.last = now  # last: its last arrival (when its blocks were last read)
        self.completed: float | None = None
        self.stop = UNKNOWN_STOP
        self.inflight = 0
        self.finished = False
        self.waiting = 0  # subagents announced by a hint: the next gap is a SUBAGENTS gap
        self.ttl_until: float | None = None
        self.priority = 0.0
        self.rank: Key | None = None  # its key in the ranking, while listed
        self.alive = True
        self.outcome: Outcome | None = None  # its last completion, until it comes back


class Ranking:
    """Agents holding keys, ascending by ``key_of(agent, now)``: the end is evicted first."""

    def __init__(self, key_of: Callable[[Agent, float], Key], refresh_s: float = 1.0) -> None:
        self.key_of, self.refresh_s = key_of, refresh_s
        self.keys: list[Key] = []
        self.agents: list[Agent] = []
        self._at = -INF
        self._stale = True
        self._dirty: set[Agent] = set()

    def touch(self, agent: Agent) -> None:
        """The agent changed (an observation, its first key): moved at the next look."""
        self._dirty.add(agent)

    def forget(self, agent: Agent) -> None:
        self._dirty.discard(agent)

    def invalidate(self) -> None:
        """Every key changed (the policy switched between recency and predictions): re-score all."""
        self._stale = True

    def current(self, now: float) -> list[Agent]:
        """The agents in order, as of ``now`` (a clock that went backwards re-scores everything)."""
        if self._stale or not self._at <= now < self._at + self.refresh_s:
            listed = {*self.agents, *self._dirty}  # every agent holding keys is listed or dirty
            for a in listed:
                a.rank = None
            entries = sorted((self.key_of(a, now), a) for a in listed if a.alive and a.count > 0)
            self.keys = [k for k, _ in entries]
            self.agents = [a for _, a in entries]
            for k, a in entries:
                a.rank = k
            self._at, self._stale = now, False
            self._dirty.clear()
        elif self._dirty:
            for agent in self._dirty:
                self._move(agent, now)
            self._dirty.clear()
        return self.agents

    def room_above(self, key: Key, agent: Agent, need: int) -> int:
        """Keys held by the agents ranked after ``key`` (predicted back later), ``agent`` left out, counted
        from the last until ``need`` (call ``current`` first)."""
        room = 0
        keys, agents = self.keys, self.agents
        j = len(agents) - 1
        while room < need and j >= 0 and keys[j] > key:
            other = agents[j]
            if other is not agent and other.alive:
                room += max(0, other.count)
            j -= 1
        return room

    def _move(self, agent: Agent, now: float) -> None:
        keys, agents = self.keys, self.agents
        if agent.rank is not None:
            i = bisect_left(keys, agent.rank)
            if i < len(keys) and agents[i] is agent:
                del keys[i], agents[i]
            agent.rank = None
        if agent.alive and agent.count > 0:
            key = self.key_of(agent, now)
            j = bisect_left(keys, key)
            keys.insert(j, key)
            agents.insert(j, agent)
            agent.rank = key
