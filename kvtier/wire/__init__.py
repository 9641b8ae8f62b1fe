"""kvtier.wire: what kvtier's daemons and their clients both speak, in one package both depend on (and neither
on the other: tests/test_layering.py holds that line).

* this module   the envelope and codec every zmq message uses (master and pool alike), the master's ops, the
                ERR_* codes, WireError, key blobs and the typed field readers;
* ``pool``      the pool protocol's ops and field layouts (bitmaps, offsets, the labels pools register under);
* ``frames``    block rows <-> zmq frames (the tcp transport and the pool's get/put);
* ``framing``   the stream data port's length-prefixed framing over raw sockets (both ends of it);
* ``generations`` the shared-memory slot-generation file: the pool bumps, one-sided readers check;
* ``verbs``     the RDMA queue pairs both ends build (pyverbs, optional), whose fields ride in ``rdma_connect``.

Errors: a daemon raises and answers only WireError (its ``code`` is on the wire, so it is shared here); the
client side turns an error reply into its own typed exceptions (kvtier.transport.PoolError and its
subclasses, kvtier.client.MasterError), which stay the SDK's: they carry client-side facts (which endpoint,
a timeout that never reached the wire) that a daemon never raises. Where a daemon acts as a client of another
daemon (a pool copying from a pool) it catches the SDK's error at that edge and answers a WireError.

The master's envelope:

One zmq frame per message, msgpack-encoded (the ROUTER side adds and strips the peer's identity frame):

    request: [VERSION, req_id, op, body]        body: a map of the op's fields
    reply:   [VERSION, req_id, ok, body]        ok False: body = {"code": ERR_*, "message": "..."}

Every request carries a ``req_id`` (an unsigned int the client chooses) that its reply echoes, so a client
can drop the late reply of a request it already timed out on. Batches of 16-byte keys travel as one binary
blob of n*16 bytes, never as n msgpack strings: the daemon reads them as an (n, 2) uint64 array with no
per-key object, and a 2,000-key prompt is one 32 KB field.

Versioning: a daemon answers a request of another ``VERSION`` with ERR_BAD_VERSION (naming both); fields
are added compatibly (readers ignore unknown fields and default missing optional ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from kvtier.keys import KEY_BYTES

VERSION = 1

# ---- ops -----------------------------------------------------------------------------------------------
# Routers and operators.
PING = "ping"
LOOKUP = "lookup"
COST = "cost"
ROUTE_PUT = "route_put"
HEAT = "heat"
TOP = "top"
NODES = "nodes"
PIN = "pin"
UNPIN = "unpin"
PRIORITY = "priority"
HINTS = "hints"
PREFETCH = "prefetch"
LOCATE = "locate"
# Operators (an operator key when the master requires keys).
FORGET = "forget"
# Nodes (kvtier.client.NodeAgent).
REGISTER = "register"
HEARTBEAT = "heartbeat"
EVENTS = "events"
INVENTORY = "inventory"
GOODBYE = "goodbye"

# Event kinds inside an EVENTS message.
ADD, REMOVE = 0, 1

# ---- error codes (the ``code`` of an error reply) ----------------------------------------------------------
ERR_BAD_MESSAGE = "bad_message"  # not msgpack, or not a [version, req_id, op, body] array
ERR_BAD_VERSION = "bad_version"
ERR_UNKNOWN_OP = "unknown_op"
ERR_BAD_REQUEST = "bad_request"  # a field is missing, of the wrong type or out of range
ERR_TOO_LARGE = "too_large"  # a batch over the daemon's --max-batch-keys
ERR_UNKNOWN_NODE = "unknown_node"  # a node op from a node the master does not know (register again)
ERR_INTERNAL = "internal"  # a bug in the daemon; the message says where, the daemon keeps serving
ERR_FORBIDDEN = "forbidden"  # the caller's key has no role that allows the op (kvtier/auth/roles.py)
ERR_NODE_OWNED = "node_owned"  # a node id another live registration owns (free once it leaves or its lease ends)
ERR_BUSY = "busy"  # too many replies unread by this client (or by all clients): read them, then retry
# The master cannot record writes now (its shared directory is unreachable, read-only or reloading): retry, maybe
# on another master. Clients with several masters fail over on it.
ERR_UNAVAILABLE = "unavailable"


class WireError(Exception):
    """A message that cannot be served as sent; ``code`` is one of the ERR_* codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# ---- frames ----------------------------------------------------------------------------------------------

def encode_request(req_id: int, op: str, body: Mapping[str, Any]) -> bytes:
    return msgpack.packb([VERSION, req_id, op, body], use_bin_type=True)


def encode_reply(req_id: int, ok: bool, body: Mapping[str, Any]) -> bytes:
    return msgpack.packb([VERSION, req_id, ok, body], use_bin_type=True)


def encode_error(req_id: int, err: WireError) -> bytes:
    return encode_reply(req_id, False, {"code": err.code, "message": err.message})


def _unpack(frame: bytes | memoryview, what: str) -> list[Any]:
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise WireError(ERR_BAD_MESSAGE, f"{what} is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(msg, list) or len(msg) != 4:
        raise WireError(ERR_BAD_MESSAGE, f"{what} must be a msgpack array [version, req_id, op, body], "
                                         f"got {_describe(msg)}")
    return msg


def decode_request(frame: bytes | memoryview) -> tuple[int, str, dict[str, Any]]:
    """(req_id, op, body), or WireError. A usable req_id is salvaged into ``WireError.req_id`` when possible."""
    msg = _unpack(frame, "request")
    version, req_id, op, body = msg
    rid = req_id if _is_uint(req_id) else 0
    try:
        if not _is_uint(req_id):
            raise WireError(ERR_BAD_MESSAGE, f"req_id must be an unsigned int, got {_describe(req_id)}")
        if version != VERSION:
            raise WireError(ERR_BAD_VERSION, f"protocol version {version!r} is not supported; "
                                             f"this daemon speaks version {VERSION}")
        if not isinstance(op, str):
            raise WireError(ERR_BAD_MESSAGE, f"op must be a string, got {_describe(op)}")
        if not isinstance(body, dict):
            raise WireError(ERR_BAD_MESSAGE, f"body must be a map, got {_describe(body)}")
    except WireError as e:
        e.req_id = rid  # type: ignore[attr-defined]
        raise
    return req_id, op, body


def decode_reply(frame: bytes | memoryview, peer: str = "the master") -> tuple[int, bool, dict[str, Any]]:
    """(req_id, ok, body) of a reply, or WireError ERR_BAD_MESSAGE (ERR_BAD_VERSION naming ``peer``)."""
    version, req_id, ok, body = _unpack(frame, "reply")
    if version != VERSION:
        raise WireError(ERR_BAD_VERSION, f"{peer} speaks protocol version {version!r}, "
                                         f"this client version {VERSION}")
    if not _is_uint(req_id) or not isinstance(ok, bool) or not isinstance(body, dict):
        raise WireError(ERR_BAD_MESSAGE, "reply must be [version, req_id:uint, ok:bool, body:map]")
    return req_id, ok, body


def salvage_req_id(err: WireError) -> int:
    return int(getattr(err, "req_id", 0))


# ---- keys ------------------------------------------------------------------------------------------------

def pack_keys(keys: Sequence[bytes] | np.ndarray | bytes) -> bytes:
    """Keys as one n*16-byte blob. Accepts a list of 16-byte keys, an (n, 2) uint64 array, or a blob."""
    if isinstance(keys, (bytes, bytearray)):
        if len(keys) % KEY_BYTES:
            raise ValueError(f"a key blob must be a multiple of {KEY_BYTES} bytes, got {len(keys)}")
        return bytes(keys)
    if isinstance(keys, np.ndarray):
        return np.ascontiguousarray(keys, dtype="<u8").tobytes()
    blob = b"".join(keys)
    if len(blob) != KEY_BYTES * len(keys):
        bad = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise ValueError(f"key {bad}: expected {KEY_BYTES} bytes, got {len(keys[bad])}")
    return blob


def unpack_keys(blob: bytes) -> list[bytes]:
    return [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


# ---- typed field readers (a wrong field is ERR_BAD_REQUEST naming it) -----------------------------------------

def _describe(v: Any) -> str:
    return f"{type(v).__name__} {v!r}"[:80]


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_MISSING = object()


def field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """body[name] checked against ``kind`` (bool is not an int; an int is accepted as a float)."""
    v = body.get(name, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise WireError(ERR_BAD_REQUEST, f"field {name!r} is missing")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, bool) and bool not in kinds:
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: expected {_kind_names(kinds)}, got bool")
    if not isinstance(v, kinds):
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: expected {_kind_names(kinds)}, got {_describe(v)}")
    return v


def int_field(body: Mapping[str, Any], name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    v = field(body, name, int, default)
    if v is not None and not lo <= v <= hi:
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: {v} is outside [{lo}, {hi}]")
    return v


def float_field(body: Mapping[str, Any], name: str, lo: float, hi: float, default: Any = _MISSING) -> float:
    v = field(body, name, float, default)
    if v is not None and not (lo <= v <= hi):  # also rejects NaN
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: {v} is outside [{lo}, {hi}]")
    return v


def str_list_field(body: Mapping[str, Any], name: str, max_len: int, default: Any = _MISSING) -> list[str]:
    v = field(body, name, list, default)
    if v is None:
        return v
    if len(v) > max_len:
        raise WireError(ERR_TOO_LARGE, f"field {name!r}: {len(v)} entries, the limit is {max_len}")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise WireError(ERR_BAD_REQUEST, f"field {name!r}[{i}]: expected str, got {_describe(s)}")
    return v


def keys_field(body: Mapping[str, Any], name: str, max_keys: int, default: Any = _MISSING) -> np.ndarray:
    """A key blob as an (n, 2) uint64 array (no copy)."""
    v = field(body, name, bytes, default)
    if v is None:
        return v
    if len(v) % KEY_BYTES:
        raise WireError(ERR_BAD_REQUEST, f"field {name!r}: {len(v)} bytes is not a whole number of "
                                         f"{KEY_BYTES}-byte keys")
    n = len(v) // KEY_BYTES
    if n > max_keys:
        raise WireError(ERR_TOO_LARGE, f"field {name!r}: {n} keys in one batch, the limit is {max_keys} "
                                       "(split the batch)")
    return np.frombuffer(v, dtype="<u8").reshape(n, 2)


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join({"bytes": "bin", "dict": "map", "list": "array"}.get(k.__name__, k.__name__) for k in kinds)
