"""What each master op sends and what it answers: request builders (``Call``) and typed results.

A ``Call`` is one request body plus the function that turns the reply body into a result object; the sync
and the asyncio client both just send Calls, so each op is written once. Field layouts here are the wire
contract the daemon's ops (master/ops_router.py, master/ops_node.py) implement.

Pure data; no I/O; thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from kvtier import wire
from kvtier.keys import KEY_BYTES
from kvtier.client.failover import MasterError

T = TypeVar("T")
KeysLike = Sequence[bytes] | np.ndarray | bytes


@dataclass(frozen=True)
class Call(Generic[T]):
    op: str
    body: dict[str, Any]
    parse: Callable[[dict[str, Any]], T]

    def result(self, body: dict[str, Any], master: str) -> T:
        """The answer ``master`` sent, parsed. An answer without the fields or types this op answers (a master
        of another version, something that is not a master) is MasterError ERR_BAD_MESSAGE naming the master
        and the op, not a KeyError or TypeError from inside the parse."""
        try:
            return self.parse(body)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise MasterError(wire.ERR_BAD_MESSAGE, f"{self.op}: malformed reply from {master}: "
                                                    f"{type(e).__name__}: {str(e)[:200]}") from None


# ---- results ---------------------------------------------------------------------------------------------

@dataclass
class NodeTierHit:
    """One entry of a MasterLookup: ``blocks`` leading keys of the lookup are held in ``tier`` of ``node``."""

    node: str
    tier: str
    blocks: int


@dataclass
class MasterLookup:
    """The master's answer to a lookup: per (node, tier), the leading keys held; ``any``: leading keys held by
    at least one live node."""

    n: int
    any: int
    hits: list[NodeTierHit]

    def best(self) -> NodeTierHit | None:
        return max(self.hits, key=lambda h: h.blocks, default=None)

    def for_node(self, node: str) -> dict[str, int]:
        return {h.tier: h.blocks for h in self.hits if h.node == node}


@dataclass
class Plan:
    """The master's estimate for serving the prompt on ``worker`` (seconds; tokens are block tokens)."""

    worker: str
    prefix_tokens: int  # leading tokens some live node holds
    local_tokens: dict[str, int]  # of those, loaded from the worker's own tiers, by tier
    remote_tokens: int  # of those, fetched from other nodes
    load_s: float  # load the whole prefix
    recompute_s: float  # recompute the whole prefix instead
    load_tokens: int  # the cheapest plan: load this many leading tokens...
    recompute_tokens: int  # ...and recompute the rest of the prompt
    total_s: float  # its estimated seconds
    sources: dict[str, int] = field(default_factory=dict)  # blocks per source ("local/dram", "node-b/ssd")
    load_bytes: int = 0  # bytes the cheapest plan loads (a hybrid prompt: its restore point's objects too)

    @classmethod
    def from_wire(cls, p: Mapping[str, Any]) -> Plan:
        plan = p["plan"]
        return cls(worker=p["worker"], prefix_tokens=p["prefix_tokens"], local_tokens=p["local_tokens"],
                   remote_tokens=p["remote_tokens"], load_s=p["load_s"], recompute_s=p["recompute_s"],
                   load_tokens=plan["load_tokens"], recompute_tokens=plan["recompute_tokens"],
                   total_s=plan["total_s"], sources=plan["sources"], load_bytes=plan["load_bytes"])


@dataclass
class CostResult:
    n: int
    prefix_blocks: int
    plans: list[Plan]


@dataclass
class HeatResult:
    """Per key: access count, decayed heat (accesses, halving every half-life), last access (unix s, 0: never)."""

    count: list[int]
    heat: list[float]
    last: list[int]


@dataclass
class TopResult:
    keys: list[bytes]
    heat: list[float]
    count: list[int]
    last: list[int]


@dataclass
class MasterHints:
    """The master's hints record (``hints``): the pins and priorities it keeps. Expiry times are unix seconds;
    ``float('inf')``: no expiry."""

    version: int
    key_pins: dict[bytes, float] = field(default_factory=dict)
    session_pins: dict[str, float] = field(default_factory=dict)
    key_priority: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    session_priority: dict[str, tuple[int, float]] = field(default_factory=dict)
    unchanged: bool = False  # the reply to hints(since=version): nothing changed, the maps are empty

    @classmethod
    def from_wire(cls, b: Mapping[str, Any]) -> MasterHints:
        if b.get("unchanged"):
            return cls(version=b["version"], unchanged=True)

        def t(x: float) -> float:
            return float("inf") if x == 0 else x

        pins, prio = b["pins"], b["priority"]
        return cls(
            version=b["version"],
            key_pins={k: t(e) for k, e in zip(wire.unpack_keys(pins["keys"]), pins["expires"])},
            session_pins={s: t(e) for s, e in b["session_pins"].items()},
            key_priority={k: (lv, t(e)) for k, lv, e in zip(wire.unpack_keys(prio["keys"]), prio["levels"],
                                                               prio["expires"])},
            session_priority={s: (lv, t(e)) for s, (lv, e) in b["session_priority"].items()},
        )


@dataclass
class LocateResult:
    """Per key, one live (node, tier, address) holding it: ``holders[where[i]]``, or None where ``where[i]`` is -1."""

    holders: list[tuple[str, str, str]]
    where: list[int]

    def holder(self, i: int) -> tuple[str, str, str] | None:
        w = self.where[i]
        return self.holders[w] if w >= 0 else None


@dataclass
class PrefetchResult:
    """The master's answer to ``prefetch`` (master/prefetch.py). ``outcome``: accepted, clipped (accepted, the
    prefix cut to what live nodes hold and the node's top tier fits), ignored (the node's top tier holds it
    already), rejected (nothing queued); ``why`` says why. ``asked``: keys sent; ``queued``: keys the node is
    sent (0 for a session the node resolves); ``held``: leading keys some live node holds; ``in_top``: of those,
    in the node's top tier now; ``expires``: unix s by which the node must collect the order (0: none queued)."""

    outcome: str
    why: str
    session: str
    asked: int
    queued: int
    held: int
    in_top: int
    expires: float

    @classmethod
    def from_wire(cls, b: Mapping[str, Any]) -> PrefetchResult:
        return cls(outcome=b["outcome"], why=b["why"], session=b["session"], asked=b["asked"], queued=b["queued"],
                   held=b["held"], in_top=b["in_top"], expires=float(b["expires"]))


@dataclass
class PrefetchOrder:
    """One prefetch order a node collects in its heartbeat reply: bring ``keys`` (root first; empty: the last
    prefix the node remembers for ``session``) up into its top tier, if collected before ``expires`` (unix s)."""

    session: str
    keys: list[bytes]
    expires: float


@dataclass
class NodeReply:
    """The master's answer to register / heartbeat / events / inventory."""

    resync: bool  # send a full inventory
    applied_seq: int | None
    lease_s: float | None = None
    hints_version: int | None = None
    next_part: int | None = None
    max_batch_keys: int | None = None  # register: the most keys one events message or inventory part may carry
    # heartbeat, pools with hot-block replication on (master/replication.py): copy these keys from these pools,
    # [(source node, source address, keys)], and remove these replicas
    replicate: list[tuple[str, str, list[bytes]]] = field(default_factory=list)
    drop: list[bytes] = field(default_factory=list)
    prefetch: list[PrefetchOrder] = field(default_factory=list)  # heartbeat: orders for this node's store

    @classmethod
    def from_wire(cls, b: Mapping[str, Any]) -> NodeReply:
        return cls(resync=bool(b.get("resync", False)), applied_seq=b.get("applied_seq"),
                   lease_s=b.get("lease_s"), hints_version=b.get("hints_version"), next_part=b.get("next_part"),
                   max_batch_keys=b.get("max_batch_keys"),
                   replicate=[(src, addr, wire.unpack_keys(keys)) for src, addr, keys in b.get("replicate", [])],
                   drop=wire.unpack_keys(b["drop"]) if b.get("drop") else [],
                   prefetch=[PrefetchOrder(s, wire.unpack_keys(k), float(e)) for s, k, e in b.get("prefetch", [])])


# ---- calls -----------------------------------------------------------------------------------------------

def _keys(keys: KeysLike) -> bytes:
    return wire.pack_keys(keys)


def _hint_body(keys: KeysLike | None, session: str | None) -> dict[str, Any]:
    if keys is None and session is None:
        raise ValueError("give keys or a session (or both)")
    body: dict[str, Any] = {}
    if keys is not None:
        body["keys"] = _keys(keys)
    if session is not None:
        body["session"] = session
    return body


def ping() -> Call[dict[str, Any]]:
    return Call(wire.PING, {}, dict)


def lookup(keys: KeysLike, touch: bool = True) -> Call[MasterLookup]:
    return Call(wire.LOOKUP, {"keys": _keys(keys), "touch": touch},
                lambda b: MasterLookup(b["n"], b["any"], [NodeTierHit(*h) for h in b["prefix"]]))


def cost(keys: KeysLike, candidates: Sequence[str], block_tokens: int, prefill_tokens_per_s: float,
         prompt_tokens: int | None = None, touch: bool = True,
         checkpoints: Sequence[tuple[int, KeysLike]] | None = None) -> Call[CostResult]:
    """Where serving a prompt whose full-history blocks are ``keys`` is cheapest. ``checkpoints``: a hybrid
    model's prompt (sliding-window or recurrent groups besides full attention) can be restored only at these
    boundaries: (blocks, the keys of the other objects restoring there needs: its recurrent state, its window
    groups' tail blocks), ascending; a boundary one of whose objects no live node holds is priced as
    recomputed, and a plan loads a restore point's objects with the blocks before it."""
    model: dict[str, Any] = {"block_tokens": block_tokens, "prefill_tokens_per_s": prefill_tokens_per_s}
    if prompt_tokens is not None:
        model["prompt_tokens"] = prompt_tokens
    body: dict[str, Any] = {"keys": _keys(keys), "candidates": list(candidates), "model": model, "touch": touch}
    if checkpoints is not None:
        packed = [(int(at), _keys(ks)) for at, ks in checkpoints]
        body["checkpoints"] = {"at": [at for at, _ in packed], "counts": [len(b) // KEY_BYTES for _, b in packed],
                               "keys": b"".join(b for _, b in packed)}
    return Call(wire.COST, body,
                lambda b: CostResult(b["n"], b["prefix_blocks"], [Plan.from_wire(p) for p in b["plans"]]))


def route_put(sizes: Sequence[int], requester: str | None = None, keys: KeysLike | None = None,
              policy: str | None = None, labels: Mapping[str, str] | None = None
              ) -> Call[list[tuple[str, str] | None]]:
    """``labels``: place only on nodes registered with these labels (e.g. {"role": "pool"})."""
    body: dict[str, Any] = {"sizes": [int(s) for s in sizes], "requester": requester, "policy": policy}
    if keys is not None:
        body["keys"] = _keys(keys)
    if labels:
        body["labels"] = dict(labels)
    return Call(wire.ROUTE_PUT, body, lambda b: [tuple(t) if t else None for t in b["targets"]])  # type: ignore[misc]


def locate(keys: KeysLike, labels: Mapping[str, str] | None = None, touch: bool = True) -> Call[LocateResult]:
    """Where each key is held (one live holder per key), among nodes with ``labels`` if given; ``touch``: count
    an access of each key found (its heat: what hot-block replication looks at)."""
    body: dict[str, Any] = {"keys": _keys(keys), "touch": touch}
    if labels:
        body["labels"] = dict(labels)
    return Call(wire.LOCATE, body, lambda b: LocateResult([tuple(h) for h in b["holders"]], b["where"]))  # type: ignore[misc]


def heat(keys: KeysLike) -> Call[HeatResult]:
    return Call(wire.HEAT, {"keys": _keys(keys)}, lambda b: HeatResult(b["count"], b["heat"], b["last"]))


def top(n: int) -> Call[TopResult]:
    return Call(wire.TOP, {"n": n},
                lambda b: TopResult(wire.unpack_keys(b["keys"]), b["heat"], b["count"], b["last"]))


def nodes() -> Call[list[dict[str, Any]]]:
    return Call(wire.NODES, {}, lambda b: b["nodes"])


def pin(keys: KeysLike | None = None, session: str | None = None, ttl_s: float = 0.0) -> Call[int]:
    return Call(wire.PIN, {**_hint_body(keys, session), "ttl_s": ttl_s}, lambda b: b["count"])


def unpin(keys: KeysLike | None = None, session: str | None = None) -> Call[int]:
    return Call(wire.UNPIN, _hint_body(keys, session), lambda b: b["count"])


def priority(level: int, keys: KeysLike | None = None, session: str | None = None, ttl_s: float = 0.0) -> Call[int]:
    return Call(wire.PRIORITY, {**_hint_body(keys, session), "level": level, "ttl_s": ttl_s}, lambda b: b["count"])


def hints(since: int = -1) -> Call[MasterHints]:
    return Call(wire.HINTS, {"since": since}, MasterHints.from_wire)


def prefetch(node: str, keys: KeysLike | None = None, session: str | None = None,
             ttl_s: float = 30.0) -> Call[PrefetchResult]:
    """Ask ``node`` (the worker that will serve the prompt) to bring the prompt's prefix ``keys`` (root first) up
    into its top tier, or, with ``session`` alone, the last prefix it remembers for that agent. The order waits
    at the master for the node's next heartbeat, at most ``ttl_s`` (master/prefetch.py)."""
    body = {**_hint_body(keys, session), "node": node, "ttl_s": float(ttl_s)}
    return Call(wire.PREFETCH, body, PrefetchResult.from_wire)


def forget(node: str) -> Call[bool]:
    """An operator drops a node from the master now (made dead first if it is not): its placements, its record
    on disk. True if the master knew it. Needs an operator key when the master requires keys."""
    return Call(wire.FORGET, {"node": node}, lambda b: bool(b["forgotten"]))


# Node side (kvtier.client.NodeAgent uses these; a benchmark or a custom node may too).

def register(node: str, incarnation: str, seq: int, tiers: Sequence[tuple[str, int]], address: str = "",
             labels: Mapping[str, str] | None = None) -> Call[NodeReply]:
    return Call(wire.REGISTER, {"node": node, "incarnation": incarnation, "seq": seq, "address": address,
                                "tiers": [[name, int(cap)] for name, cap in tiers], "labels": dict(labels or {})},
                NodeReply.from_wire)


def heartbeat(node: str, incarnation: str, seq: int, used: Mapping[str, int], bw: Mapping[str, float],
              path_bw: Mapping[str, float], rpc_latency_s: float) -> Call[NodeReply]:
    return Call(wire.HEARTBEAT, {"node": node, "incarnation": incarnation, "seq": seq, "used": dict(used),
                                 "bw": dict(bw), "path_bw": dict(path_bw), "rpc_latency_s": rpc_latency_s},
                NodeReply.from_wire)


def events(node: str, incarnation: str, seq: int,
           batch: Sequence[tuple[int, str, KeysLike, int]]) -> Call[NodeReply]:
    """``batch``: (wire.ADD or wire.REMOVE, tier, keys, block_bytes) in the order they happened."""
    return Call(wire.EVENTS, {"node": node, "incarnation": incarnation, "seq": seq,
                              "events": [[kind, tier, _keys(keys), int(size)] for kind, tier, keys, size in batch]},
                NodeReply.from_wire)


def inventory(node: str, incarnation: str, seq: int, part: int, last: bool, tiers: Mapping[str, KeysLike],
              block_bytes: Mapping[str, int]) -> Call[NodeReply]:
    return Call(wire.INVENTORY, {"node": node, "incarnation": incarnation, "seq": seq, "part": part, "last": last,
                                 "tiers": {t: _keys(k) for t, k in tiers.items()},
                                 "block_bytes": {t: int(b) for t, b in block_bytes.items()}},
                NodeReply.from_wire)


def goodbye(node: str, incarnation: str) -> Call[NodeReply]:
    """The node is leaving: the master drops its placements now rather than when its lease runs out."""
    return Call(wire.GOODBYE, {"node": node, "incarnation": incarnation}, NodeReply.from_wire)
