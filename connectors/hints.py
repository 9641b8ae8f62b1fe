"""Agent hints: what a request asks the store to do with its blocks, read once per request for every connector
(``read_hints``: each value checked once, by one set of rules, for the pins and for the eviction policy alike).

    {"kvtier": {"ttl_s": 600, "session": "agent-42", "priority": 1, "finished": false, "subagents": 3}}

``ttl_s`` keeps the request's blocks pinned in the store for ``ttl_s`` seconds under one lease per session (each turn
of the session extends it; ``TieredStore.leases``, lease ``kvtier.store.leases.session_lease(session)``: the one a
kvtier-master session pin holds), so the next turn finds its prefix even if DRAM is busy; ``priority``
decides which sessions keep their pins when hints pin more than the connector's ``hint_max_fraction`` of the
DRAM blocks. ``session`` names the agent, ``finished`` says this is its last request and ``subagents`` that it
waits for that many subagents next: inputs to the session-aware eviction policy (connectors/vllm/observe.py).
vLLM carries the dict in ``kv_transfer_params`` (connectors/vllm/hints.py); SGLang in a storage call's
``HiCacheStorageExtraInfo.extra_info``. A bad value is logged naming the request and dropped, the others kept: a
hint never fails a request. No engine import.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentHints:
    """An agent's hint for a request's blocks: keep them pinned for ``ttl_s`` seconds under lease ``session``
    (one lease per session, extended by each turn); ``priority`` decides which sessions keep their pins when
    hints pin too much."""

    session: str
    ttl_s: float
    priority: float = 0.0


@dataclass(frozen=True)
class RequestHints:
    """A request's ``kvtier`` hints, each checked (None: not given, or given and refused)."""

    session: str | None = None
    finished: bool | None = None
    subagents: int | None = None
    ttl_s: float | None = None
    priority: float | None = None

    def pin(self, default_session: str | None) -> AgentHints | None:
        """The pin these hints ask for (``ttl_s`` given), under ``session`` or else ``default_session``."""
        session = self.session or default_session
        if self.ttl_s is None or session is None:
            return None
        return AgentHints(session, self.ttl_s, self.priority or 0.0)

    @property
    def for_policy(self) -> bool:
        """Whether any value besides the session is an input to the eviction policy."""
        return any(v is not None for v in (self.finished, self.subagents, self.ttl_s, self.priority))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS = {
    "session": lambda v: isinstance(v, str) and v != "",
    "finished": lambda v: isinstance(v, bool),
    "subagents": lambda v: type(v) is int and 0 <= v < 1 << 20,  # noqa: E721 - not a bool
    "ttl_s": lambda v: _number(v) and 0 < v < math.inf,
    "priority": lambda v: _number(v) and math.isfinite(v),
}
_FLOATS = ("ttl_s", "priority")


def read_hints(params: Any, owner: str) -> RequestHints | None:
    """The hints in ``params["kvtier"]`` (vLLM's ``kv_transfer_params``, SGLang's ``extra_info``), each value
    checked; a bad one is logged naming ``owner`` (e.g. the request) and dropped. None if there is no such dict."""
    raw = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(raw, dict):
        return None
    good: dict[str, Any] = {}
    for name, ok in _CHECKS.items():
        if name in raw:
            if ok(raw[name]):
                good[name] = float(raw[name]) if name in _FLOATS else raw[name]
            else:
                log.warning("kvtier: %s: ignoring hint %s=%r", owner, name, raw[name])
    return RequestHints(**good)


def parse_hints(params: Any, default_session: str | None, owner: str) -> AgentHints | None:
    """The pin the hints in ``params["kvtier"]`` ask for (read_hints, then RequestHints.pin)."""
    hints = read_hints(params, owner)
    return hints.pin(default_session) if hints is not None else None
