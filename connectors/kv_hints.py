"""The engines' standard agent-hint envelope, applied to a store: vLLM's ``Request.kv_hints`` (0.32-0.34,
``vllm/v1/kv_hints/protocol.py``) and SGLang's ``GenerateReqInput.kv_hints`` (0.5.23, the same field names).

    KvHintsEnvelope(protocol_version, message_id, actions=[KvHintAction(action_id, action_type, action_version,
                                                                        payload: dict)])

Neither engine defines action names in code; kvtier takes SGLang RFC #27574's (``SUPPORTED``, version "1" each;
both engines type the versions as strings, an integer 1 is read as "1"):

  Prefetch  bring the request's prefix up into DRAM now (Prefetcher.request, for the request's agent), if the
            store has a prefetcher (a tier below DRAM); a prefix longer than DRAM is clipped to what it holds
  Pin       keep the request's blocks pinned for ``payload["ttl_s"]`` seconds (a lease bounded by ``MAX_PIN_S``:
            longer is clipped)
  Retain    rank the agent's blocks by ``payload["priority"]`` (higher: evicted later); only a priority
  Demote    the agent's blocks go first (priority -1, unless the payload gives a lower one)
  Share     the blocks serve several agents: a store already shares identical blocks by key, so nothing to do

Each action gets one outcome (``OUTCOMES``): accepted, clipped (applied within a bound), deferred (nothing to
apply it to yet: e.g. no blocks held), rejected (malformed, unknown action or version) or ignored (understood,
nothing to do here). ``HintOutcomes`` counts them per action and outcome (what a connector exports as a metric)
and logs each as one event line. A hint never fails a request and never changes which bytes a key holds.
Envelopes are read by attribute (msgspec structs) or key (dicts: SGLang over HTTP); no engine import.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.store.leases import session_lease
from kvtier.policies import Hint, Observations

log = logging.getLogger(__name__)

PROTOCOL_VERSIONS = ("1",)
SUPPORTED = {"Prefetch": "1", "Pin": "1", "Retain": "1", "Demote": "1", "Share": "1"}
OUTCOMES = ("accepted", "clipped", "deferred", "rejected", "ignored")
MAX_PIN_S = 3600.0
MAX_ACTIONS = 16  # per envelope; the rest rejected


def supported_hints() -> dict[str, Any]:
    """What kvtier applies of the standard envelope (``kvtier status`` shows it: neither engine lets a connector
    advertise its actions to a client)."""
    return {"protocol_versions": list(PROTOCOL_VERSIONS), "actions": dict(SUPPORTED)}


def describe_hints(hints: dict[str, Any]) -> str:
    """``supported_hints()`` on one line."""
    actions = ", ".join(f"{name} v{version}" for name, version in hints["actions"].items())
    return f"protocol {'/'.join(hints['protocol_versions'])}: {actions}"


@dataclass(frozen=True)
class Applied:
    """One action's outcome: ``action`` its type (as sent, cut to 64 characters), ``outcome`` one of OUTCOMES,
    ``why`` a short reason."""

    action: str
    outcome: str
    why: str = ""


class HintOutcomes:
    """Counts of outcomes per (action, outcome); thread-safe. ``counts`` is what a metric exports."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def record(self, owner: str, applied: Sequence[Applied]) -> None:
        with self._lock:
            for a in applied:
                self.counts[(a.action if a.action in SUPPORTED else "other", a.outcome)] += 1
        for a in applied:
            log.info("kvtier hint event: %s %s %s%s", owner, a.action, a.outcome, f" ({a.why})" if a.why else "")

    def take(self) -> dict[str, int]:
        """The counts since the last take, as ``hint_<action>_<outcome>`` counters (a connector's stats), reset."""
        with self._lock:
            out = {f"hint_{action}_{outcome}": n for (action, outcome), n in self.counts.items()}
            self.counts.clear()
        return out


def _version(v: Any) -> str | None:
    """A version as the engines type it (a string); an integer (a hand-written dict) reads as its digits."""
    if isinstance(v, str):
        return v
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def apply_kv_hints(envelope: Any, store: Any, session: str | None, keys: Sequence[bytes], *,
                   prefetcher: Any = None, now: float | None = None, request: str | None = None,
                   only: str | None = None) -> list[Applied]:
    """Apply ``envelope``'s actions to ``store`` for the request of ``session`` whose chain is ``keys``
    (root first); the outcome of each action, in order. ``prefetcher``: a kvtier.prefetch.Prefetcher or None.
    ``request``: the request's id, for the policy to find the agent when ``session`` is None (the client named
    none: the policy inferred the agent from the chains) and to name the Pin's lease then. ``only``: apply the
    actions of this type alone (the others get no outcome): a connector retrying a deferred Pin."""
    if envelope is None:
        return []
    version = _version(_field(envelope, "protocol_version"))
    actions = _field(envelope, "actions")
    if version not in PROTOCOL_VERSIONS or not isinstance(actions, (list, tuple)):
        return [Applied("envelope", "rejected", f"protocol_version {version!r} (supported: {PROTOCOL_VERSIONS}) "
                                                "or no list of actions")]
    out = []
    for i, action in enumerate(actions):
        kind = str(_field(action, "action_type"))[:64]
        if only is not None and kind != only:
            continue
        if i >= MAX_ACTIONS:
            out.append(Applied(kind, "rejected", f"more than {MAX_ACTIONS} actions in one envelope"))
            continue
        out.append(_apply(kind, action, store, session, keys, prefetcher, now, request))
    return out


def _apply(kind: str, action: Any, store: Any, session: str | None, keys: Sequence[bytes], prefetcher: Any,
           now: float | None, request: str | None) -> Applied:
    if kind not in SUPPORTED:
        return Applied(kind, "rejected", f"unknown action (supported: {', '.join(SUPPORTED)})")
    if _version(_field(action, "action_version")) != SUPPORTED[kind]:
        return Applied(kind, "rejected", f"action_version {_field(action, 'action_version')!r}, "
                                         f"supported {SUPPORTED[kind]}")
    payload = _field(action, "payload") or {}
    if not isinstance(payload, dict):
        return Applied(kind, "rejected", "payload must be a dict")
    if kind == "Share":
        return Applied(kind, "ignored", "blocks are shared by key already")
    if kind == "Prefetch":
        return _prefetch(store, session, keys, prefetcher, request)
    if kind == "Pin":
        ttl = _number(payload.get("ttl_s"))
        if ttl is None or ttl <= 0:
            return Applied(kind, "rejected", "payload ttl_s must be a positive number")
        clipped = ttl > MAX_PIN_S
        held = store.leases.lease(session_lease(session or request or ""), list(keys), min(ttl, MAX_PIN_S),
                                  _number(payload.get("priority")) or 0.0)
        if not any(held):
            return Applied(kind, "deferred", "none of the blocks is held yet")
        return Applied(kind, "clipped" if clipped else "accepted", f"ttl_s cut to {MAX_PIN_S:g}" if clipped else "")
    priority = _number(payload.get("priority"))
    if kind == "Retain":
        if priority is None:
            return Applied(kind, "rejected", "payload priority must be a finite number")
    else:  # Demote
        priority = min(-1.0, priority) if priority is not None else -1.0
    store.observe(hints=[Hint(request=request, session=session, time=now, priority=priority)])
    return Applied(kind, "accepted")


def _prefetch(store: Any, session: str | None, keys: Sequence[bytes], prefetcher: Any, request: str | None) -> Applied:
    """A Prefetch: the request's chain (at most what DRAM holds, root first: clipped past it) handed to the
    prefetcher under the agent the store's policy knows the request by (the client's session, its current branch,
    or the agent inferred from the chains), which the room a prefetch gets is reckoned for."""
    if prefetcher is None:
        return Applied("Prefetch", "ignored", "no tier below DRAM to prefetch from (or the prefetch setting is off)")
    agent = store.sessions.resolve(Observations((), (), [Hint(request=request, session=session)])).hints[0].session
    if agent is None or not keys:
        return Applied("Prefetch", "deferred", "the request's agent or blocks are not known to the store yet")
    room = store.capacity_blocks
    prefetcher.request(agent, list(keys[:room]))
    if len(keys) > room:
        return Applied("Prefetch", "clipped", f"{len(keys)} blocks cut to the {room} DRAM holds")
    return Applied("Prefetch", "accepted")


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)
