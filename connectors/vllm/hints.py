"""Agent hints: what a request's ``kv_transfer_params["kvtier"]`` asks the store to do with its blocks.

    {"kv_transfer_params": {"kvtier": {"ttl_s": 600, "session": "agent-42", "priority": 1}}}

keeps the request's blocks pinned in the store for ``ttl_s`` seconds under one lease per session (each turn
of the session extends it), so the next turn finds its prefix even if DRAM is busy; ``priority`` decides
which sessions keep their pins when hints pin more than ``hint_max_fraction`` of the DRAM blocks. Read on
the scheduler (``hints_of``), carried in each SavePlan, applied by the worker after the save
(``TieredStore.leases``, lease ``kvtier.leases.session_lease(session)``: the one a kvtier-master session pin
holds, so a router can extend a session on every node). vLLM's Request fields are read through compat.py.
"""

from __future__ import annotations

from typing import Any

from kvtier.connectors.hints import AgentHints, parse_hints

from .compat import request_session_id, request_transfer_params

__all__ = ["AgentHints", "hints_of"]


def hints_of(request: Any) -> AgentHints | None:
    """The agent hints in ``request.kv_transfer_params["kvtier"]`` (kvtier.connectors.hints.parse_hints);
    ``session`` defaults to vLLM's session id, else the request id."""
    params = request_transfer_params(request) or {}
    default = request_session_id(request) or request.request_id
    return parse_hints(params, default, f"request {request.request_id}")
