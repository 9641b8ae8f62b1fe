"""The shape of what ``kvtier status`` reads from a master, checked in one place before anything reads it.

A master of another version, a proxy, or something that is not a master at all may answer with fields missing
or of the wrong type, and the screen used to die deep inside with a KeyError or TypeError traceback.
``check(shape, value, what, master)`` walks a reply against its shape (PING, NODES, TOP below: every field
``status.render`` or ``--json`` reads) and raises MalformedStatus naming the master and the first field that
is wrong: ``nodes[2].tiers[0].used: expected a count (an int >= 0), got str '12'``. Numbers must be finite
(an infinite uptime does not render) and times within what a datetime holds. Fields the screen reads with a
default may be missing; fields it does not read are not looked at (a newer master may add some).

Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvtier.keys import KEY_BYTES

Check = Callable[[Any, str], None]
MAX_TIMESTAMP = 253402300799  # 9999-12-31T23:59:59Z: the last second datetime.fromtimestamp takes


class MalformedStatus(ValueError):
    """A master's reply is not the shape the status screen reads: ``where`` names the field."""

    def __init__(self, master: str, where: str, problem: str) -> None:
        super().__init__(f"master {master} answered a malformed status: {where}: {problem}")
        self.master, self.where, self.problem = master, where, problem


class _Wrong(Exception):
    def __init__(self, where: str, problem: str) -> None:
        super().__init__(where, problem)
        self.where, self.problem = where, problem


def check(shape: Check, value: Any, what: str, master: str) -> None:
    """``value`` (the reply to ``what``) against ``shape``; MalformedStatus naming ``master`` and the field."""
    try:
        shape(value, what)
    except _Wrong as e:
        raise MalformedStatus(master, e.where, e.problem) from None


def _describe(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _expect(ok: bool, v: Any, where: str, expected: str) -> None:
    if not ok:
        raise _Wrong(where, f"expected {expected}, got {_describe(v)}")


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- field kinds: each is check(value, where) ---------------------------------------------------------------

def count(v: Any, where: str) -> None:
    _expect(isinstance(v, int) and not isinstance(v, bool) and v >= 0, v, where, "a count (an int >= 0)")


def number(v: Any, where: str) -> None:
    _expect(_real(v) and math.isfinite(v), v, where, "a finite number")


def duration(v: Any, where: str) -> None:
    _expect(_real(v) and math.isfinite(v) and v >= 0, v, where, "seconds (a finite number >= 0)")


def timestamp(v: Any, where: str) -> None:
    _expect(_real(v) and math.isfinite(v) and 0 <= v <= MAX_TIMESTAMP, v, where,
            f"unix seconds (0 to {MAX_TIMESTAMP})")


def text(v: Any, where: str) -> None:
    _expect(isinstance(v, str), v, where, "a string")


def key(v: Any, where: str) -> None:
    _expect(isinstance(v, bytes) and len(v) == KEY_BYTES, v, where, f"a {KEY_BYTES}-byte key")


def nullable(kind: Check) -> Check:
    def check_nullable(v: Any, where: str) -> None:
        if v is not None:
            kind(v, where)
    return check_nullable


def list_of(kind: Check) -> Check:
    def check_list(v: Any, where: str) -> None:
        _expect(isinstance(v, list), v, where, "an array")
        for i, item in enumerate(v):
            kind(item, f"{where}[{i}]")
    return check_list


def map_of(kind: Check) -> Check:
    def check_map(v: Any, where: str) -> None:
        _expect(isinstance(v, dict), v, where, "a map")
        for k, item in v.items():
            _expect(isinstance(k, str), k, f"{where} (a key)", "a string")
            kind(item, f"{where}.{k}")
    return check_map


def record(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """A map with ``required`` fields and ``optional`` ones (may be missing; None is not a value unless the
    field's kind is nullable); other fields are not looked at."""
    def check_record(v: Any, where: str) -> None:
        _expect(isinstance(v, dict), v, where, "a map")
        for name, kind in required.items():
            if name not in v:
                raise _Wrong(f"{where}.{name}", "missing")
            kind(v[name], f"{where}.{name}")
        for name, kind in (optional or {}).items():
            if name in v:
                kind(v[name], f"{where}.{name}")
    return check_record


def same_length(*names: str) -> Check:
    """The arrays ``names`` of a map are of one length (TOP: one entry per key, in four columns)."""
    def check_lengths(v: dict[str, Any], where: str) -> None:
        lengths = {n: len(v[n]) for n in names}
        if len(set(lengths.values())) > 1:
            raise _Wrong(where, "arrays of different lengths: " + ", ".join(f"{n} {k}" for n, k in lengths.items()))
    return check_lengths


def both(*kinds: Check) -> Check:
    def check_all(v: Any, where: str) -> None:
        for kind in kinds:
            kind(v, where)
    return check_all


# ---- what the status screen reads ---------------------------------------------------------------------------

BACKEND = record({}, {"kind": text, "state": text, "why": text, "url": text, "entry": count})
ERROR = record({"at": timestamp, "op": text, "code": text, "message": text})
ACTIVITY = record({}, {"lookups": record({}, {"count": count, "keys": count, "hits": count, "misses": count}),
                       "requests": map_of(map_of(count)), "recent_errors": list_of(ERROR)})
PING = record({}, {"uptime_s": duration, "lease_s": duration, "keys": count, "directory_bytes": count,
                   "locations": count, "backend": BACKEND, "nodes": map_of(count), "activity": ACTIVITY})
TIER = record({"name": text, "capacity": count, "used": count}, {"bw": nullable(number)})
NODE = record({"node": text, "state": text}, {"address": nullable(text), "silent_s": duration,
                                              "rpc_latency_s": nullable(number), "tiers": nullable(list_of(TIER)),
                                              "labels": nullable(map_of(text))})
NODES = list_of(NODE)
TOP = both(record({"keys": list_of(key), "heat": list_of(number), "count": list_of(count),
                   "last": list_of(timestamp)}), same_length("keys", "heat", "count", "last"))
