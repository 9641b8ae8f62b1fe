"""What the scheduler knows about requests, carried to every worker's store for its eviction policy.

The scheduler sees each request arrive (its block hashes, its session), finish (the stop reason, the blocks its
output added) and the client's hints in ``kv_transfer_params["kvtier"]``; the stores live in the workers. So
the scheduler writes it all down (``Notebook``) and each step's connector metadata carries the notes
(``RequestNotes``) to every rank, whose worker hands them to its store (``RequestNotes.apply`` ->
``TieredStore.observe``): every rank's policy sees the same requests, hence infers the same agents.

Times travel as ages (seconds before the metadata was built, on the scheduler's clock): a worker places them on
its own clock, which need not be the scheduler's (another host). vLLM's Request fields are read through compat.py;
pickled with the metadata.

Client hints (all optional; a bad value is logged and ignored, never fails a request):

    {"kv_transfer_params": {"kvtier": {"session": "agent-42", "finished": true, "subagents": 3,
                                       "ttl_s": 600, "priority": 1}}}

``session``: the agent (default: vLLM's ``session_id``, else inferred from the chains); ``finished``: this is
the session's last request (its blocks are not worth keeping); ``subagents``: after this request the agent
waits for that many subagents; ``ttl_s`` / ``priority``: as for the pins (hints.py), also inputs to the policy.
The scheduler reads them once per request (hints.request_hints: kvtier.connectors.hints.read_hints) and hands
them to ``Notebook.arrived``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.connectors.hints import RequestHints
from kvtier.keys import Namespace
from kvtier.policies import Arrival, Completion, Hint
from kvtier.store import TieredStore

from .compat import request_session_id, request_stop_reason


@dataclass(frozen=True)
class ArrivalNote:
    req_id: str
    hashes: tuple[bytes, ...]  # the request's full blocks, root first
    session: str | None
    age_s: float
    # A hybrid model's checkpoints the request restores from or makes, as block boundaries (blocks of the chain
    # before each): the worker names their objects (state, window tails) for the policy, which keeps them by agent.
    checkpoints: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompletionNote:
    req_id: str
    stop: str | None
    hashes: tuple[bytes, ...]  # blocks its output added after the arrival's
    age_s: float


@dataclass(frozen=True)
class HintNote:
    req_id: str
    session: str | None
    finished: bool
    subagents: int
    ttl_s: float | None
    priority: float | None
    age_s: float


@dataclass
class RequestNotes:
    """One step's notes (empty most steps but the first and last of a request)."""

    arrivals: list[ArrivalNote] = field(default_factory=list)
    completions: list[CompletionNote] = field(default_factory=list)
    hints: list[HintNote] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.arrivals or self.completions or self.hints)

    def apply(self, store: TieredStore, namespace: Namespace,
              checkpoint_keys: Callable[[Sequence[bytes], int], list[bytes]] | None = None) -> None:
        """Tell ``store`` (a worker's), with the hashes folded into this rank's ``namespace`` and the ages
        placed on the store's clock. ``checkpoint_keys(hashes, boundary)``: the store keys of a hybrid model's
        checkpoint objects at ``boundary`` of the chain ``hashes`` (the worker's groups and namespaces)."""
        now = store.clock()
        arrivals = [Arrival(a.req_id, namespace.keys(a.hashes), now - a.age_s, a.session,
                            [(b, checkpoint_keys(a.hashes, b)) for b in a.checkpoints]
                            if checkpoint_keys is not None else ())
                    for a in self.arrivals]
        hints = [Hint(h.req_id, h.session, now - h.age_s, h.finished, h.subagents, h.ttl_s, h.priority)
                 for h in self.hints]
        completions = [Completion(c.req_id, now - c.age_s, c.stop, namespace.keys(c.hashes))
                       for c in self.completions]
        # Hints ride with the arrival (the client sends them with the request), before its completion.
        store.observe(arrivals, (), hints)
        if completions:
            store.observe((), completions)


class Notebook:
    """The scheduler's notes since the last step. Scheduler thread only."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._arrivals: list[tuple[str, tuple[bytes, ...], str | None, float, tuple[int, ...]]] = []
        self._completions: list[tuple[str, str | None, tuple[bytes, ...], float]] = []
        self._hints: list[tuple[str, str | None, bool, int, float | None, float | None, float]] = []

    def arrived(self, request: Any, hashes: Sequence[bytes], hints: RequestHints | None,
                checkpoints: Sequence[int] = ()) -> None:
        """``request`` was admitted with these full blocks (root first), its ``hints`` (read once by the
        scheduler: hints.request_hints) and, for a hybrid model, these checkpoint boundaries (ArrivalNote); its
        hints go with it."""
        session = (hints.session if hints is not None else None) or request_session_id(request)
        now = self.clock()
        self._arrivals.append((request.request_id, tuple(hashes), session if isinstance(session, str) else None,
                               now, tuple(checkpoints)))
        if hints is not None and hints.for_policy:
            self._hints.append((request.request_id, None, bool(hints.finished), hints.subagents or 0, hints.ttl_s,
                                hints.priority, now))

    def finished(self, request: Any, added: Sequence[bytes]) -> None:
        """``request`` finished; ``added``: the full blocks its output added after its arrival's."""
        self._completions.append((request.request_id, stop_reason(request), tuple(added), self.clock()))

    def take(self) -> RequestNotes:
        now = self.clock()
        notes = RequestNotes([ArrivalNote(r, h, s, now - t, c) for r, h, s, t, c in self._arrivals],
                             [CompletionNote(r, s, h, now - t) for r, s, h, t in self._completions],
                             [HintNote(r, s, f, n, ttl, p, now - t) for r, s, f, n, ttl, p, t in self._hints])
        self._arrivals, self._completions, self._hints = [], [], []
        return notes


def stop_reason(request: Any) -> str | None:
    """vLLM's finish reason as a stop reason: ``stop``, ``length``, ``abort``, ...; a stop on a given token or
    string is ``stop:<it>`` (e.g. Llama 3's end-of-message token, which ends a tool call, apart from its
    end-of-turn), so the policy learns one gap distribution per way an answer ends."""
    reason = request.get_finished_reason()
    if reason is None:
        return None
    name = str(reason)
    stop = request_stop_reason(request)
    return f"{name}:{stop}" if name == "stop" and stop is not None else name
