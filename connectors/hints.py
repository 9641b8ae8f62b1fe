"""Agent hints: what a request asks the store to do with its blocks, parsed once for every connector.

    {"kvtier": {"ttl_s": 600, "session": "agent-42", "priority": 1}}

keeps the request's blocks pinned in the store for ``ttl_s`` seconds under one lease per session (each turn
of the session extends it; ``TieredStore.leases``, lease ``kvtier.leases.session_lease(session)``: the one a
kvtier-master session pin holds), so the next turn finds its prefix even if DRAM is busy; ``priority``
decides which sessions keep their pins when hints pin more than the connector's ``hint_max_fraction`` of the
DRAM blocks. vLLM carries the dict in ``kv_transfer_params`` (connectors/vllm/hints.py); SGLang in a storage
call's ``HiCacheStorageExtraInfo.extra_info``. No engine import.
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


def parse_hints(params: Any, default_session: str | None, owner: str) -> AgentHints | None:
    """The hints in ``params["kvtier"]``: ``ttl_s`` (> 0, required for a hint), ``session`` (default
    ``default_session``), ``priority`` (default 0). None when there are none; bad values are logged (naming
    ``owner``, e.g. the request) and ignored: a hint never fails a request."""
    raw = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        ttl_s = float(raw.get("ttl_s", 0))
        priority = float(raw.get("priority", 0))
        session = raw.get("session") or default_session
        if not (ttl_s > 0 and math.isfinite(ttl_s) and math.isfinite(priority)) or not isinstance(session, str):
            raise ValueError(f"ttl_s must be a positive number, session a string; got {raw!r}")
    except (TypeError, ValueError) as e:
        log.warning("kvtier: ignoring hints of %s: %s", owner, e)
        return None
    return AgentHints(session, ttl_s, priority)
