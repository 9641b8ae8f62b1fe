"""Observations (kvtier/policies/observations.py) on the wire: what an engine's store tells a pool's policy.

A pool shared by several engines evicts by the same session-aware policy as their DRAM, so it needs what they
know: the agents' arrivals, completions and hints. ``encode`` turns one resolved batch (every observation has its
session and time: TieredStore.observe) into a msgpack-able body; ``decode`` checks it field by field (WireError
naming the first bad one), bounded: at most ``MAX_ITEMS`` observations and ``max_keys`` keys in one message.

Times: the sender's clock and the pool's differ. The body carries ``now``, the sender's time when it sent; a
pool shifts every time by (its own now - the sender's now), so gaps between a sender's observations keep their
length on the pool's clock (the network's delay is the error). A pool run as a replay's stand-in
(``--policy-clock sender``) takes the times as they are and reads its policy's time from them (SenderClock).

Sessions and request ids are scoped to the sender (``scope``: a prefix the pool adds), so two engines' "1"
are two agents. Body:

    {now, scope, arrivals: [[request, keys, time, session]], completions: [[request, time, stop, keys,
     session]], hints: [[request, session, time, finished, subagents, ttl_s, priority]]}

with keys as one n*16-byte blob (wire.pack_keys) and None for an absent string or number.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import wire
from kvtier.policies import Arrival, Completion, Hint, Observations
from kvtier.wire import ERR_BAD_REQUEST, ERR_TOO_LARGE, WireError

MAX_ITEMS = 4096  # observations in one message
MAX_NAME = 256  # characters of a request id, session id, stop reason or scope


def encode(batch: Observations, now: float, scope: str) -> dict[str, Any]:
    return {
        "now": now, "scope": scope,
        "arrivals": [[a.request, wire.pack_keys(list(a.keys)), a.time, a.session] for a in batch.arrivals],
        "completions": [[c.request, c.time, c.stop, wire.pack_keys(list(c.keys)), c.session]
                        for c in batch.completions],
        "hints": [[h.request, h.session, h.time, h.finished, h.subagents, h.ttl_s, h.priority] for h in batch.hints],
    }


def split(batch: Observations, max_keys: int) -> list[Observations]:
    """``batch`` cut into batches of at most ``max_keys`` keys and MAX_ITEMS observations each, in order (an
    arrival longer than ``max_keys`` keeps its root-most keys: its chain's deepest part is what goes first)."""
    out: list[Observations] = []
    arrivals: list[Arrival] = []
    completions: list[Completion] = []
    keys = items = 0

    def cut() -> None:
        nonlocal arrivals, completions, keys, items
        if arrivals or completions:
            out.append(Observations(arrivals, completions))
        arrivals, completions, keys, items = [], [], 0, 0

    for a in batch.arrivals:
        if len(a.keys) > max_keys:
            a = Arrival(a.request, list(a.keys)[:max_keys], a.time, a.session)
        if keys + len(a.keys) > max_keys or items >= MAX_ITEMS:
            cut()
        arrivals.append(a)
        keys, items = keys + len(a.keys), items + 1
    for c in batch.completions:
        if len(c.keys) > max_keys:
            c = Completion(c.request, c.time, c.stop, list(c.keys)[:max_keys], c.session)
        if keys + len(c.keys) > max_keys or items >= MAX_ITEMS:
            cut()
        completions.append(c)
        keys, items = keys + len(c.keys), items + 1
    cut()
    hints = list(batch.hints)
    for i in range(0, len(hints), MAX_ITEMS):
        out.append(Observations(hints=hints[i:i + MAX_ITEMS]))
    return out


def decode(body: dict[str, Any], max_keys: int, shift: Callable[[float], float] | None = None,
           account: str = "") -> Observations:
    """The batch a body carries, its sessions and requests prefixed with its scope (and the sender's
    ``account``, where its key proves one) and its times moved by ``shift`` (sender time -> the pool's; None:
    as sent). WireError for a malformed or too large body."""
    scope = _name(body.get("scope"), "scope") or ""
    if account:
        scope = f"{account}/{scope}"
    arrivals, completions, hints = (_list(body, k) for k in ("arrivals", "completions", "hints"))
    if len(arrivals) + len(completions) + len(hints) > MAX_ITEMS:
        raise WireError(ERR_TOO_LARGE, f"{len(arrivals) + len(completions) + len(hints)} observations in one "
                                       f"message; at most {MAX_ITEMS}")
    move = shift or (lambda t: t)
    budget = [max_keys]

    def keys(blob: Any, what: str) -> list[bytes]:
        if not isinstance(blob, (bytes, bytearray)):
            raise WireError(ERR_BAD_REQUEST, f"{what}: keys must be bytes")
        if len(blob) % 16:
            raise WireError(ERR_BAD_REQUEST, f"{what}: {len(blob)} bytes of keys, not a multiple of 16")
        budget[0] -= len(blob) // 16
        if budget[0] < 0:
            raise WireError(ERR_TOO_LARGE, f"more than {max_keys} keys in one observe message")
        return wire.unpack_keys(bytes(blob))

    def scoped(v: Any, what: str) -> str | None:
        name = _name(v, what)
        return None if name is None else f"{scope}|{name}"

    out_a = []
    for item in arrivals:
        request, blob, t, session = _row(item, 4, "arrival")
        out_a.append(Arrival(_req(scoped(request, "arrival request")), keys(blob, "arrival"),
                             _time(t, move), scoped(session, "arrival session")))
    out_c = []
    for item in completions:
        request, t, stop, blob, session = _row(item, 5, "completion")
        out_c.append(Completion(_req(scoped(request, "completion request")), _time(t, move), _name(stop, "stop"),
                                keys(blob, "completion"), scoped(session, "completion session")))
    out_h = []
    for item in hints:
        request, session, t, finished, subagents, ttl_s, priority = _row(item, 7, "hint")
        out_h.append(Hint(scoped(request, "hint request"), scoped(session, "hint session"), _time(t, move),
                          bool(finished), _count(subagents), _number(ttl_s, "ttl_s"), _number(priority, "priority")))
    return Observations(out_a, out_c, out_h)


class SenderClock:
    """A policy clock that reads the latest ``now`` the senders' observations carried (never going back): a
    pool standing in for a replay's second node, whose time is the replay's virtual clock. Thread-safe."""

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def saw(self, now: float) -> None:
        with self._lock:
            if now > self._now:
                self._now = now

    def __call__(self) -> float:
        return self._now


def _list(body: dict[str, Any], name: str) -> Sequence[Any]:
    v = body.get(name, [])
    if not isinstance(v, (list, tuple)):
        raise WireError(ERR_BAD_REQUEST, f"{name} must be a list")
    return v


def _row(item: Any, n: int, what: str) -> Sequence[Any]:
    if not isinstance(item, (list, tuple)) or len(item) != n:
        raise WireError(ERR_BAD_REQUEST, f"an {what} must be a list of {n} fields")
    return item


def _name(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > MAX_NAME:
        raise WireError(ERR_BAD_REQUEST, f"{what} must be a string of at most {MAX_NAME} characters")
    return v


def _req(v: str | None) -> str:
    if v is None:
        raise WireError(ERR_BAD_REQUEST, "an observation needs its request id")
    return v


def _number(v: Any, what: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError(ERR_BAD_REQUEST, f"{what} must be a finite number")
    return float(v)


def _time(v: Any, move: Callable[[float], float]) -> float | None:
    t = _number(v, "time")
    return None if t is None else move(t)


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 20:
        raise WireError(ERR_BAD_REQUEST, "subagents must be an integer in 0..2^20")
    return v
