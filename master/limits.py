"""The size of every field a kvtier-master request may carry, in one place, and the readers that enforce them.

Why: everything the master keeps (node records, labels, addresses, hints, session names) came in a request,
so the master's memory has a ceiling only if every field has one. A field over its limit is refused with
ERR_TOO_LARGE or ERR_BAD_REQUEST naming the field and the limit, before anything is kept. The counts the
master keeps (nodes, locations, hints) are bounded by MasterSettings; the whole message by zmq's
MAXMSGSIZE (``MasterSettings.max_message_bytes``). docs/reliability.md lists them all.

Lengths are in characters (a Python str holds at most 4 bytes per character). Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.wire import ERR_BAD_REQUEST, ERR_TOO_LARGE, WireError, field

MAX_NAME = 256  # node ids, tier names, candidate worker names, the requester of a route_put
MAX_INCARNATION = 128  # a node's incarnation (NodeAgent sends 32 hex digits)
MAX_ADDRESS = 512  # a node's endpoint (tcp://host:port)
MAX_SESSION = 512  # an agent session's name in pin / unpin / priority
MAX_LABELS = 32  # labels per node, and per label filter of route_put / locate
MAX_LABEL_KEY = 64
MAX_LABEL_VALUE = 256
MAX_TIERS = 8  # tiers per node (each becomes a directory location: a bit in every entry's mask)
MAX_PEERS = 256  # path_bw entries per heartbeat (peer node ids)
MAX_CANDIDATES = 4096  # candidate workers per cost query
MAX_POLICY = 64  # a placement policy's name
MAX_CHECKPOINTS = 4096  # a hybrid prompt's restore points per cost query

Body = Mapping[str, Any]
_MISSING = object()


def text(body: Body, key: str, limit: int, *, default: Any = _MISSING, empty: bool = False) -> Any:
    """``body[key]``: a string of 1..limit characters (0..limit with ``empty``); ``default`` when absent."""
    v = field(body, key, str) if default is _MISSING else field(body, key, str, default)
    if v is None:
        return None
    if len(v) > limit:
        raise WireError(ERR_TOO_LARGE, f"field {key!r}: {len(v)} characters, the limit is {limit}")
    if not v and not empty:
        raise WireError(ERR_BAD_REQUEST, f"field {key!r}: must not be empty")
    return v


def name(body: Body, key: str) -> str:
    """A name field (a node id): 1..MAX_NAME characters."""
    return text(body, key, MAX_NAME)


def checked_str(v: Any, what: str, limit: int) -> str:
    """A string found inside a structure (a list item, a map key), 1..limit characters."""
    if not isinstance(v, str):
        raise WireError(ERR_BAD_REQUEST, f"{what}: expected a string, got {type(v).__name__}")
    if not v:
        raise WireError(ERR_BAD_REQUEST, f"{what}: must not be empty")
    if len(v) > limit:
        raise WireError(ERR_TOO_LARGE, f"{what}: {len(v)} characters, the limit is {limit}")
    return v


def str_map(body: Body, key: str, kind: type | tuple[type, ...], max_entries: int,
            max_key: int = MAX_NAME) -> dict[str, Any]:
    """A map of short strings to values of ``kind`` (bool is not a number), at most ``max_entries``."""
    m = field(body, key, dict, default={})
    if len(m) > max_entries:
        raise WireError(ERR_TOO_LARGE, f"field {key!r}: {len(m)} entries, the limit is {max_entries}")
    for k, v in m.items():
        checked_str(k, f"field {key!r}: a key", max_key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise WireError(ERR_BAD_REQUEST, f"field {key!r}: entry {k[:64]!r} must map to "
                                             f"{getattr(kind, '__name__', kind)}")
    return m


def labels(body: Body, key: str = "labels") -> dict[str, str]:
    """Node labels, or a label filter: at most MAX_LABELS, keys and values of bounded length."""
    m = field(body, key, dict, default={})
    if len(m) > MAX_LABELS:
        raise WireError(ERR_TOO_LARGE, f"field {key!r}: {len(m)} labels, the limit is {MAX_LABELS}")
    for k, v in m.items():
        checked_str(k, f"field {key!r}: a label name", MAX_LABEL_KEY)
        if not isinstance(v, str):
            raise WireError(ERR_BAD_REQUEST, f"field {key!r}: label {k!r} must be a string")
        if len(v) > MAX_LABEL_VALUE:
            raise WireError(ERR_TOO_LARGE, f"field {key!r}: label {k!r} is {len(v)} characters, the limit is "
                                           f"{MAX_LABEL_VALUE}")
    return m


def int_list(body: Body, key: str, max_entries: int, lo: int, hi: int) -> list[int]:
    """A list of at most ``max_entries`` integers, each in [lo, hi] (bool is not an integer here)."""
    v = field(body, key, list)
    if len(v) > max_entries:
        raise WireError(ERR_TOO_LARGE, f"field {key!r}: {len(v)} entries, the limit is {max_entries}")
    for i, x in enumerate(v):
        if type(x) is not int or not lo <= x <= hi:  # noqa: E721 - bool is not a count
            raise WireError(ERR_BAD_REQUEST, f"field {key!r}[{i}]: expected an integer in [{lo}, {hi}]")
    return v


def str_list(body: Body, key: str, max_entries: int, max_len: int = MAX_NAME) -> list[str]:
    v = field(body, key, list)
    if len(v) > max_entries:
        raise WireError(ERR_TOO_LARGE, f"field {key!r}: {len(v)} entries, the limit is {max_entries}")
    for i, s in enumerate(v):
        checked_str(s, f"field {key!r}[{i}]", max_len)
    return v
