"""SessionTracker: which agent each observation belongs to, given by the client or inferred from the chains.

An agent is a line of requests each extending the chain of the one before. Without a session id it is
inferred: a request whose chain extends the chain of an earlier request (that request's last block sits in
it, at the same depth) belongs to that request's agent; any other request starts a new agent. With the
client's session id, the agent is the session's current branch: its requests are the session's (never another
agent's, whatever prefixes they share), and one that does not extend the session's latest chain (a compacted
context, a retry from an earlier turn) starts a new branch (``session#N``), so the blocks of the abandoned one
are not kept as if the agent were coming back for them (on the standard slice keeping them cost 11 points at
DRAM 5%). On agentic traffic inferred agents and sessions agree: 99.9% of reusable blocks are reused by the same
agent's next request (POLICY-STUDY.md).

Memory is bounded and per agent, not per block: the last block of each agent's latest chain (``max_agents``
of them, the least recently active forgotten first) and the agent of each recent request (``max_requests``,
the oldest forgotten first: a completion never sent costs nothing, a hint after a completion still finds it). Work is O(batch): an arrival looks its own
keys up, once each. Inferred agents are named ``~1``, ``~2``, ... (``INFERRED``); a client's id that starts
with ``~`` is kept apart by a prefix, so the two never collide.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from kvtier.policies.base import Clock
from kvtier.policies.observations import Arrival, Completion, Hint, Observations

INFERRED = "~"


class SessionTracker:
    """Fills in ``session`` and ``time`` on every observation of a batch. Thread-safe (one lock)."""

    def __init__(self, clock: Clock, max_agents: int = 1 << 16, max_requests: int = 1 << 16) -> None:
        if max_agents < 1 or max_requests < 1:
            raise ValueError(f"max_agents and max_requests must be >= 1, got {max_agents}, {max_requests}")
        self.clock = clock
        self.max_agents, self.max_requests = max_agents, max_requests
        self._tails: OrderedDict[bytes, str] = OrderedDict()  # last key of an agent's latest chain -> agent
        self._tail_of: dict[str, bytes] = {}  # agent -> that key
        self._requests: OrderedDict[str, str] = OrderedDict()  # request in flight -> agent
        self._branch: OrderedDict[str, str] = OrderedDict()  # client session -> its current branch (an agent)
        self._turns: dict[str, int] = {}  # client session -> requests seen (bounded with _branch)
        self.counts = {"arrivals": 0, "completions": 0, "hints": 0}
        self._next = 0
        self._lock = threading.Lock()

    def resolve(self, batch: Observations) -> Observations:
        """The batch with every observation's session (agent) and time filled in. Completions and hints of
        requests never seen (or forgotten) get session None: policies ignore them."""
        with self._lock:
            now = self.clock()
            counts = self.counts
            counts["arrivals"] += len(batch.arrivals)
            counts["completions"] += len(batch.completions)
            counts["hints"] += len(batch.hints)
            arrivals = [self._arrival(a, now) for a in batch.arrivals]
            completions = [self._completion(c, now) for c in batch.completions]
            hints = [self._hint(h, now) for h in batch.hints]
        return Observations(arrivals, completions, hints)

    def __len__(self) -> int:
        """Agents remembered."""
        return len(self._tail_of)

    def stats(self, sessions: int = 256) -> dict[str, object]:
        """Counts of what was observed, agents and requests remembered, and the ``sessions`` most recently
        active client sessions: requests seen (``turns``) and current branch (``TieredStore.stats()``
        reports this under ``"observations"``)."""
        with self._lock:
            recent = list(self._branch.items())[-sessions:]
            return {**self.counts, "agents": len(self._tail_of), "requests": len(self._requests),
                    "sessions": {s: {"turns": self._turns.get(s, 0), "branch": b} for s, b in reversed(recent)}}

    @property
    def requests(self) -> int:
        """Requests remembered."""
        return len(self._requests)

    # ---- internals (lock held) ------------------------------------------------------------------------

    def _arrival(self, a: Arrival, now: float) -> Arrival:
        keys = a.keys
        session = _named(a.session)
        agent = self._inferred(keys) if session is None else self._branch_of(session, keys)
        if keys:
            self._set_tail(agent, keys[-1])
        requests = self._requests
        requests[a.request] = agent
        requests.move_to_end(a.request)
        while len(requests) > self.max_requests:
            requests.popitem(last=False)
        return replace(a, session=agent, time=now if a.time is None else a.time)

    def _inferred(self, keys: Sequence[bytes]) -> str:
        """The agent whose latest chain this one extends (the deepest earlier tail it passes through, looked up
        in a C loop), or a new one."""
        agent = next(filter(None, map(self._tails.get, reversed(keys))), None)
        if agent is None:
            self._next += 1
            agent = f"{INFERRED}{self._next}"
        return agent

    def _branch_of(self, session: str, keys: Sequence[bytes]) -> str:
        """The session's current branch, or a new one if this chain does not extend its latest chain."""
        branch = self._branch
        agent = branch.get(session)
        tail = self._tail_of.get(agent) if agent is not None else None
        if agent is None or (tail is not None and tail not in keys):
            self._next += 1
            agent = session if agent is None else f"{session}#{self._next}"
        branch[session] = agent
        branch.move_to_end(session)
        self._turns[session] = self._turns.get(session, 0) + 1
        while len(branch) > self.max_agents:
            self._turns.pop(branch.popitem(last=False)[0], None)
        return agent

    def _set_tail(self, agent: str, key: bytes) -> None:
        tails, tail_of = self._tails, self._tail_of
        old = tail_of.get(agent)
        if old is not None and tails.get(old) == agent:
            del tails[old]
        previous = tails.get(key)
        if previous is not None and previous != agent:
            tail_of.pop(previous, None)  # another agent's tail is now this one's: the chain moved on here
        tails[key] = agent
        tails.move_to_end(key)
        tail_of[agent] = key
        while len(tails) > self.max_agents:
            _, gone = tails.popitem(last=False)
            tail_of.pop(gone, None)

    def _completion(self, c: Completion, now: float) -> Completion:
        # The request stays known (a hint may follow its completion); the bound forgets it later.
        agent = self._current(c.session)
        if agent is None:
            agent = self._requests.get(c.request)
        if agent is not None and c.keys:
            self._set_tail(agent, c.keys[-1])  # its output extends the chain the next request continues
        return replace(c, session=agent, time=now if c.time is None else c.time)

    def _current(self, session: str | None) -> str | None:
        """The agent a client's session id names now: its current branch."""
        named = _named(session)
        return self._branch.get(named, named) if named is not None else None

    def _hint(self, h: Hint, now: float) -> Hint:
        agent = self._current(h.session)
        if agent is None and h.request is not None:
            agent = self._requests.get(h.request)
        return replace(h, session=agent, time=now if h.time is None else h.time)


def _named(session: str | None) -> str | None:
    """A client's session id as an agent name (never one an inferred agent could have)."""
    if session is None:
        return None
    return INFERRED + session if session.startswith(INFERRED) else session
