"""Prefetch orders: a router or an operator asks that a node bring a prompt's prefix up into its top tier (DRAM).

``prefetch`` (the op; ``MasterClient.prefetch`` / ``Router.prefetch`` in the SDK) names the node that will serve
the prompt and the prompt's keys (root first), or a session whose last prefix the node remembers. The master
answers at once, from what it knows:

* ``rejected``: the node is not registered or is dead (no live lease: it would never collect the order), no live
  node holds the prefix's first key (unknown keys: there is nothing to bring up), or the node already has
  ``MAX_ORDERS_PER_NODE`` orders waiting / the master ``MAX_QUEUED_KEYS`` keys of orders (a flood);
* ``ignored``: the node's top tier holds the whole held prefix already;
* ``clipped``: accepted, but only the leading keys some live node holds, and at most as many blocks as the node's
  top tier can hold (a prefix bigger than DRAM brings up its head, which a prompt reads first);
* ``accepted``: the whole prefix is queued.

The order waits here for the node's next heartbeat, whose reply carries it (``prefetch``: [session, keys,
expires]); the node's StorePrefetch hands it to the store's Prefetcher (kvtier/client/store_prefetch.py), which
copies from wherever the node's store reaches the blocks (its SSD, a pool through its pool tier). An order the
node has not collected by ``expires`` (``ttl_s`` after it was accepted: a node that died within its lease) is
dropped and counted ``expired``. A second order for the same (node, session) replaces the first.

Orders are a recorded write: with a shared directory (master/shared.py) every master applies the op and the
heartbeat that takes the work from the log, so whichever master a node heartbeats hands it the same orders; the
shared snapshot carries them (``export`` / ``load``), so a master that loads it gives the same answers. A single
master does not write them to its lmdb: a restarted one has none (they are short-lived by design). Bounded: at most
``MAX_ORDERS_PER_NODE`` per node and ``MAX_QUEUED_KEYS`` keys in all. Every outcome is counted
(``kvtier_master_prefetches_total{outcome}``); each refusal and expiry leaves a log line (rate-limited) naming
who asked, for which node, what and why. Master event loop only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier import wire
from kvtier.keys import KEY_BYTES
from kvtier.master import limits
from kvtier.master.access import ANONYMOUS, Caller
from kvtier.master.nodes import DEAD
from kvtier.ratelog import RateLimitedLog
from kvtier.wire import float_field, keys_field

if TYPE_CHECKING:
    from kvtier.master.service import MasterState

log = logging.getLogger("kvtier.master")
_refusals = RateLimitedLog(log, 1.0)

MAX_ORDERS_PER_NODE = 64
MAX_QUEUED_KEYS = 1 << 20  # 16 MiB of keys waiting, all nodes together
DEFAULT_TTL_S = 30.0
MAX_TTL_S = 600.0
OUTCOMES = ("accepted", "clipped", "ignored", "rejected", "delivered", "expired")


@dataclass
class _Order:
    session: str
    keys: bytes  # packed, root first; b"": the node resolves the session's last prefix
    expires: float  # unix s
    who: str

    @property
    def nkeys(self) -> int:
        return len(self.keys) // KEY_BYTES


class PrefetchOrders:
    """Per node, the orders waiting for its next heartbeat (see the module doc)."""

    def __init__(self) -> None:
        self._by_node: dict[str, OrderedDict[str, _Order]] = {}
        self.queued_keys = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_node.values())

    def export(self) -> dict[str, list[list[Any]]]:
        """The orders waiting, per node, in order (a shared snapshot's)."""
        return {node: [[o.session, o.keys, o.expires, o.who] for o in q.values()] for node, q in self._by_node.items()}

    def load(self, orders: Mapping[str, list[list[Any]]]) -> None:
        """Replace the orders with an ``export``'s."""
        self._by_node = {node: OrderedDict((o[0], _Order(o[0], bytes(o[1]), float(o[2]), o[3])) for o in q)
                         for node, q in orders.items()}
        self.queued_keys = sum(o.nkeys for q in self._by_node.values() for o in q.values())

    def add(self, st: MasterState, node: str, order: _Order) -> str | None:
        """Queue ``order`` for ``node``; None, or why it was refused (a flood)."""
        now = st.wall()
        queue = self._by_node.setdefault(node, OrderedDict())
        self._expire(st, node, queue, now)
        if order.session not in queue and len(queue) >= MAX_ORDERS_PER_NODE:
            return f"node {node!r} has {len(queue)} prefetches waiting for its next heartbeat (at most " \
                   f"{MAX_ORDERS_PER_NODE})"
        if self._over(queue, order):
            self.prune(st)
            queue = self._by_node.setdefault(node, OrderedDict())  # prune drops emptied queues
            if self._over(queue, order):
                return f"the master holds {self.queued_keys} keys of prefetches waiting (at most {MAX_QUEUED_KEYS})"
        old = queue.pop(order.session, None)  # a repeat replaces its session's order: no growth
        self.queued_keys += order.nkeys - (old.nkeys if old is not None else 0)
        queue[order.session] = order
        return None

    def _over(self, queue: OrderedDict[str, _Order], order: _Order) -> bool:
        old = queue.get(order.session)
        return self.queued_keys - (old.nkeys if old is not None else 0) + order.nkeys > MAX_QUEUED_KEYS

    def work_for(self, st: MasterState, node: str) -> dict[str, Any]:
        """The orders ``node`` collects (its heartbeat reply carries them), taken."""
        queue = self._by_node.pop(node, None)
        if not queue:
            return {}
        self._expire(st, node, queue, st.wall())
        self.queued_keys -= sum(o.nkeys for o in queue.values())
        if queue:
            st.metrics.prefetches.labels("delivered").inc(len(queue))
        return {"prefetch": [[o.session, o.keys, o.expires] for o in queue.values()]} if queue else {}

    def prune(self, st: MasterState) -> None:
        """Drop expired orders and those of nodes that are gone or dead (the timer, and a full queue)."""
        now = st.wall()
        for node in list(self._by_node):
            queue = self._by_node[node]
            n = st.registry.nodes.get(node)
            if n is None or n.state == DEAD:
                for o in queue.values():
                    o.expires = min(o.expires, now)
            self._expire(st, node, queue, now)
            if not queue:
                del self._by_node[node]

    def _expire(self, st: MasterState, node: str, queue: OrderedDict[str, _Order], now: float) -> None:
        for session in [s for s, o in queue.items() if o.expires <= now]:
            o = queue.pop(session)
            self.queued_keys -= o.nkeys
            st.metrics.prefetches.labels("expired").inc()
            _refusals("expired", logging.WARNING, "prefetch expired: node %r did not collect %s's order for "
                      "session %r (%d keys) before its deadline", node, o.who, session, o.nkeys)


def prefetch(st: MasterState, body: Mapping[str, Any], caller: Caller = ANONYMOUS) -> dict[str, Any]:
    """The op (see the module doc): {node, keys?, session?, ttl_s?} -> {outcome, why, session, asked, queued,
    held (leading keys some live node holds), in_top (of those, in the node's top tier), expires}. It counts no
    access of the keys (no heat): it is a write every master of a shared directory applies, and the request it
    prepares is counted when it is looked up."""
    node_id = limits.name(body, "node")
    keys = keys_field(body, "keys", st.settings.max_batch_keys, default=None)
    session = limits.text(body, "session", limits.MAX_SESSION, default=None)
    if keys is None and session is None:
        raise wire.WireError(wire.ERR_BAD_REQUEST, "give 'keys' (the prompt's, root first) or 'session' (or both)")
    ttl = float_field(body, "ttl_s", 0.001, MAX_TTL_S, default=DEFAULT_TTL_S)
    who = caller.quota[:12] or "anonymous"
    n = 0 if keys is None else len(keys)
    if session is None:
        session = "prefetch:" + keys[0].tobytes().hex()[:16] if n else "prefetch:"
    reply: dict[str, Any] = {"session": session, "asked": n, "queued": 0, "held": 0, "in_top": 0, "expires": 0.0}

    def answer(outcome: str, why: str) -> dict[str, Any]:
        st.metrics.prefetches.labels(outcome).inc()
        if outcome == "rejected":
            _refusals("rejected", logging.WARNING, "prefetch refused: %s asked node %r for session %r (%d keys): %s",
                      who, node_id, session, n, why)
        return {**reply, "outcome": outcome, "why": why}

    st.expire_leases()
    node = st.registry.nodes.get(node_id)
    if node is None:
        return answer("rejected", f"node {node_id!r} is not registered with this master")
    if node.state == DEAD:
        return answer("rejected", f"node {node_id!r} is dead (no live lease): it would never collect the order")
    take = 0
    why = ""
    if keys is not None:
        slots, masks = st.directory.masks(keys, st.live_mask())
        held = masks.any(axis=1)
        counts = st.directory.prefix_counts(masks, held)
        top = next(iter(node.tiers.values()))
        top_loc = node.locations.get(top.name)
        in_top = counts.by_location.get(top_loc, 0) if top_loc is not None else 0
        reply.update(held=counts.any, in_top=in_top)
        if counts.any == 0:
            return answer("rejected", "no live node holds the prefix's first key (unknown keys)")
        if in_top >= counts.any:
            return answer("ignored", f"node {node_id!r}'s {top.name} holds the whole held prefix "
                                     f"({counts.any} blocks) already")
        take = counts.any
        if take < n:
            why = f"only the first {take} of {n} keys are held by a live node"
        block = int(st.directory.block_bytes(slots[:take]).max(initial=0))
        fits = top.capacity // block if block else take
        if take > fits:
            why = (f"{why}; " if why else "") + f"the prefix's {take} blocks ({take * block} bytes) are more than " \
                  f"node {node_id!r}'s {top.name} holds ({top.capacity} bytes): its first {fits}"
            take = fits
        if take == 0:
            return answer("rejected", why)
    order = _Order(session, b"" if keys is None else np.ascontiguousarray(keys[:take]).tobytes(),
                   st.wall() + ttl, who)
    refused = st.prefetches.add(st, node_id, order)
    if refused is not None:
        return answer("rejected", refused)
    reply.update(expires=order.expires, queued=order.nkeys)
    if keys is None:
        return answer("accepted", f"the node brings up session {session!r}'s last prefix, if it remembers it")
    return answer("clipped" if why else "accepted", why or f"{take} blocks queued for node {node_id!r}")
