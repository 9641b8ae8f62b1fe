"""Agent hints: what a request's ``kv_transfer_params["kvtier"]`` asks the store to do with its blocks.

    {"kv_transfer_params": {"kvtier": {"ttl_s": 600, "session": "agent-42", "priority": 1}}}

keeps the request's blocks pinned in the store for ``ttl_s`` seconds under one lease per session (each turn
of the session extends it), so the next turn finds its prefix even if DRAM is busy; ``priority`` decides
which sessions keep their pins when hints pin more than ``hint_max_fraction`` of the DRAM blocks. Read on
the scheduler (``hints_of``), carried in each SavePlan, applied by the worker after the save
(``TieredStore.leases``, lease ``kvtier.leases.session_lease(session)``: the one a kvtier-master session pin
holds, so a router can extend a session on every node). No vLLM import.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hints:
    """An agent's hint for a request's blocks (from its ``kv_transfer_params["kvtier"]``): keep them pinned
    for ``ttl_s`` seconds under lease ``session`` (one lease per session, extended by each turn);
    ``priority`` decides which sessions keep their pins when hints pin too much."""

    session: str
    ttl_s: float
    priority: float = 0.0


def hints_of(request: Any) -> Hints | None:
    """The agent hints in ``request.kv_transfer_params["kvtier"]``: ``ttl_s`` (> 0, required for a hint),
    ``session`` (default: vLLM's session id, else the request id), ``priority`` (default 0). Bad values are
    logged and ignored: a hint never fails a request."""
    params = getattr(request, "kv_transfer_params", None) or {}
    raw = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        ttl_s = float(raw.get("ttl_s", 0))
        priority = float(raw.get("priority", 0))
        session = raw.get("session") or getattr(request, "session_id", None) or request.request_id
        if not (ttl_s > 0 and math.isfinite(ttl_s) and math.isfinite(priority)) or not isinstance(session, str):
            raise ValueError(f"ttl_s must be a positive number, session a string; got {raw!r}")
    except (TypeError, ValueError) as e:
        log.warning("kvtier: ignoring hints of request %s: %s", request.request_id, e)
        return None
    return Hints(session, ttl_s, priority)
