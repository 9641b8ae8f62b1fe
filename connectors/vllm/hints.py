"""Agent hints: what a request's ``kv_transfer_params["kvtier"]`` asks the store to do with its blocks.

    {"kv_transfer_params": {"kvtier": {"ttl_s": 600, "session": "agent-42", "priority": 1}}}

keeps the request's blocks pinned in the store for ``ttl_s`` seconds under one lease per session (each turn
of the session extends it), so the next turn finds its prefix even if DRAM is busy; ``priority`` decides
which sessions keep their pins when hints pin more than ``hint_max_fraction`` of the DRAM blocks. Read once per
request on the scheduler when it is admitted (``request_hints``: kvtier.connectors.hints.read_hints, one check of
each value for the pin, the policy's notes (observe.py) and the envelope's note alike), the pin (``pin_of``)
carried in each SavePlan, applied by the worker after the save
(``TieredStore.leases``, lease ``kvtier.store.leases.session_lease(session)``: the one a kvtier-master session pin
holds, so a router can extend a session on every node). vLLM's Request fields are read through compat.py.

The engine's standard envelope (``Request.kv_hints``: Prefetch / Pin / Retain / Demote / Share, kvtier's
connectors/kv_hints.py) is read on the scheduler when the request is admitted (``kv_hints_note``), carried in
that step's metadata to every worker, and applied to its store there before the step's loads and saves: a Pin
leases the blocks of the request's prefix the store holds by then. A first turn's blocks are not stored yet: its
Pin is ``deferred`` and applied again (counted again) when the request has finished and its saves are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.connectors.hints import AgentHints, RequestHints, read_hints

from .compat import request_kv_hints, request_session_id, request_transfer_params

__all__ = ["AgentHints", "KvHintsNote", "RequestHints", "kv_hints_note", "pin_of", "request_hints"]


def request_hints(request: Any) -> RequestHints | None:
    """The hints in ``request.kv_transfer_params["kvtier"]``, each value checked (read_hints); None if none."""
    return read_hints(request_transfer_params(request), f"request {request.request_id}")


def pin_of(request: Any, hints: RequestHints | None) -> AgentHints | None:
    """The pin ``hints`` (the request's, request_hints) ask for; its session defaults to vLLM's session id, else
    the request id."""
    return hints.pin(request_session_id(request) or request.request_id) if hints is not None else None


@dataclass(frozen=True)
class KvHintsNote:
    """A request's standard hint envelope on its way to the workers: ``hashes`` its full blocks when admitted
    (root first), ``session`` the client's (None: the policy finds the agent by ``req_id``)."""

    req_id: str
    session: str | None
    hashes: tuple[bytes, ...]
    envelope: Any  # vLLM's KvHintsEnvelope (a msgspec struct: pickles with the metadata)


def kv_hints_note(request: Any, hashes: tuple[bytes, ...], hints: RequestHints | None) -> KvHintsNote | None:
    """The note of ``request.kv_hints``, or None if it has none. Its session is the one the arrival's note names
    (observe.py: ``kv_transfer_params["kvtier"]["session"]``, else vLLM's session id), so the policy sees one
    agent."""
    envelope = request_kv_hints(request)
    if envelope is None:
        return None
    session = (hints.session if hints is not None else None) or request_session_id(request)
    return KvHintsNote(request.request_id, session, hashes, envelope)
