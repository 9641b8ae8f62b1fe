"""MasterClient (blocking) and AsyncMasterClient (asyncio): talk to kvtier-master over zmq DEALER sockets.

    with MasterClient("tcp://master:7300") as m:
        hit = m.lookup(keys)                         # MasterLookup: leading blocks per node and tier
        plans = m.cost(keys, ["w1", "w2"], block_tokens=64, prefill_tokens_per_s=20_000).plans
    MasterClient("tcp://m1:7300,tcp://m2:7300,tcp://m3:7300")   # masters sharing one directory (--directory)

With several masters (a comma-separated list, or a sequence) a call goes to the one that answered last; one
that does not answer within ``timeout_s``, or answers ERR_UNAVAILABLE (its shared directory is read-only), is
put in a back-off (0.5 s doubling to 30 s, ended by its next answer) and the call goes on to the next, so a
call fails only when every master failed it, after at most one timeout per master that is down. Every op may
be retried this way: the node ops carry sequence numbers and incarnations, hints and forget are idempotent.

Every call has a timeout (``timeout_s`` per master asked); a call that times out raises MasterTimeout, and the
sync client rebuilds that socket so the next call starts clean. zmq reconnects by itself when the master
restarts on the same endpoint. A reply to an earlier, timed-out request is recognised by its req_id and
dropped. An error reply raises MasterError with the daemon's code and message (MasterUnknownNode for
ERR_UNKNOWN_NODE; an op the client's key has no role for is ERR_FORBIDDEN, its message naming the role it needs).

With ``auth`` (kvtier.auth.ClientKeys, for a master started with --auth-dir) the socket is a CurveZMQ
client. A master that refuses the keys, or wants keys the client lacks, stays silent: a timeout before any
reply says that this may be why.

MasterClient: thread-safe (one lock; calls are serialised on its socket). AsyncMasterClient: for one event
loop; many calls may be in flight at once, matched to replies by req_id. Both own their socket; close() them.
The errors and the failover (which master to ask, when a call ends) are kvtier/client/failover.py's, no I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from kvtier import wire
from kvtier.auth import ClientKeys, secure_client, silence_hint
from kvtier.client import api
from kvtier.client.api import (Call, CostResult, HeatResult, KeysLike, LocateResult, MasterHints, MasterLookup,
                               PrefetchResult, TopResult)
from kvtier.client.failover import (Failover, FailoverCall, MasterError, MasterTimeout, MasterUnknownNode, Reply,
                                    parse_endpoints)

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 2.0


def _socket(ctx: zmq.Context[Any], endpoint: str, auth: ClientKeys | None) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    secure_client(sock, endpoint, auth)  # keys, or the owner token of a keyless master of this user
    sock.connect(endpoint)
    return sock


class _Masters:
    """What both clients keep of their masters: the endpoints, the failover among them, the timeout per master
    asked, the keys, and which master answered yet (a silence before any answer may be keys refused)."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float, auth: ClientKeys | None) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.failover = Failover(self.endpoints)
        self.timeout_s = timeout_s
        self.auth = auth
        self._answered = [False] * len(self.endpoints)

    @property
    def endpoint(self) -> str:
        """The master calls go to first (the one that answered last)."""
        return self.endpoints[self.failover.preferred]

    def _timeout(self, op: str, i: int, timeout: float) -> MasterTimeout:
        """Master i did not answer ``op`` in time; before any answer from it, maybe why (keys refused)."""
        hint = "" if self._answered[i] else silence_hint(self.endpoints[i], self.auth)
        return MasterTimeout("timeout", f"{op} to {self.endpoints[i]}: no reply within {timeout:g} s{hint}")


class MasterClient(_Masters):
    """Blocking client. ``endpoints``: "tcp://127.0.0.1:7300", or several masters of one shared directory
    ("tcp://a:7300,tcp://b:7300" or a list); ``auth`` applies to each of them (masters of one cluster share
    one server keypair)."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 auth: ClientKeys | None = None) -> None:
        super().__init__(endpoints, timeout_s, auth)
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket[Any] | None] = [None] * len(self.endpoints)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.last_rtt_s = 0.0  # round trip of the last successful call (the node agent's latency signal)

    def call(self, c: Call[T], timeout_s: float | None = None) -> T:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = FailoverCall(self.failover, c.op)
        for i in attempts.order:
            body = attempts.settle(i, self._call_one(i, c, timeout))
            if body is not None:
                return c.result(body, self.endpoints[i])
        raise attempts.exhausted()

    def _call_one(self, i: int, c: Call[T], timeout: float) -> Reply | MasterError:
        """Ask master i once: its reply, or the MasterError that ended the attempt (as a value: FailoverCall)."""
        endpoint = self.endpoints[i]
        with self._lock:
            sock = self._socks[i]
            if sock is None:
                sock = self._socks[i] = _socket(self._ctx, endpoint, self.auth)
            req_id = next(self._ids)
            t0 = time.perf_counter()
            sock.send(wire.encode_request(req_id, c.op, c.body))
            deadline = t0 + timeout
            while True:
                left = deadline - time.perf_counter()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    self._reset(i)
                    return self._timeout(c.op, i, timeout)
                try:
                    rid, ok, body = wire.decode_reply(sock.recv())
                except wire.WireError as e:
                    self._reset(i)
                    return MasterError(e.code, f"{c.op}: unreadable reply from {endpoint}: {e.message}")
                if rid == req_id:
                    break  # other ids: late replies to requests that timed out
            self.last_rtt_s = time.perf_counter() - t0
            self._answered[i] = True
        return ok, body

    def _reset(self, i: int) -> None:
        """Drop a master's socket (and whatever it had queued for a dead master); the next call connects anew."""
        sock = self._socks[i]
        if sock is not None:
            sock.close(linger=0)
        self._socks[i] = None

    def close(self) -> None:
        with self._lock:
            for i in range(len(self._socks)):
                self._reset(i)
            self._ctx.term()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- ops (see kvtier.client.api for what each sends and returns) -------------------------------------

    def ping(self) -> dict[str, Any]:
        return self.call(api.ping())

    def lookup(self, keys: KeysLike, touch: bool = True) -> MasterLookup:
        return self.call(api.lookup(keys, touch))

    def cost(self, keys: KeysLike, candidates: Sequence[str], block_tokens: int, prefill_tokens_per_s: float,
             prompt_tokens: int | None = None, touch: bool = True,
             checkpoints: Sequence[tuple[int, KeysLike]] | None = None) -> CostResult:
        return self.call(api.cost(keys, candidates, block_tokens, prefill_tokens_per_s, prompt_tokens, touch,
                                  checkpoints))

    def route_put(self, sizes: Sequence[int], requester: str | None = None, keys: KeysLike | None = None,
                  policy: str | None = None, labels: Mapping[str, str] | None = None
                  ) -> list[tuple[str, str] | None]:
        return self.call(api.route_put(sizes, requester, keys, policy, labels))

    def locate(self, keys: KeysLike, labels: Mapping[str, str] | None = None, touch: bool = True) -> LocateResult:
        return self.call(api.locate(keys, labels, touch))

    def heat(self, keys: KeysLike) -> HeatResult:
        return self.call(api.heat(keys))

    def top(self, n: int) -> TopResult:
        return self.call(api.top(n))

    def nodes(self) -> list[dict[str, Any]]:
        return self.call(api.nodes())

    def pin(self, keys: KeysLike | None = None, session: str | None = None, ttl_s: float = 0.0) -> int:
        return self.call(api.pin(keys, session, ttl_s))

    def unpin(self, keys: KeysLike | None = None, session: str | None = None) -> int:
        return self.call(api.unpin(keys, session))

    def priority(self, level: int, keys: KeysLike | None = None, session: str | None = None,
                 ttl_s: float = 0.0) -> int:
        return self.call(api.priority(level, keys, session, ttl_s))

    def hints(self, since: int = -1) -> MasterHints:
        return self.call(api.hints(since))

    def prefetch(self, node: str, keys: KeysLike | None = None, session: str | None = None,
                 ttl_s: float = 30.0) -> PrefetchResult:
        return self.call(api.prefetch(node, keys, session, ttl_s))

    def forget(self, node: str) -> bool:
        return self.call(api.forget(node))


class AsyncMasterClient(_Masters):
    """asyncio client for one event loop. Calls may overlap; each waits at most ``timeout_s`` per master asked.
    ``endpoints`` as MasterClient's (one master, or several of one shared directory, failed over alike)."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 auth: ClientKeys | None = None) -> None:
        super().__init__(endpoints, timeout_s, auth)
        self._ctx = zmq.asyncio.Context()
        self._socks: list[zmq.asyncio.Socket | None] = [None] * len(self.endpoints)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[bool, dict[str, Any]]]] = {}
        self._readers: list[asyncio.Task[None] | None] = [None] * len(self.endpoints)

    async def call(self, c: Call[T], timeout_s: float | None = None) -> T:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = FailoverCall(self.failover, c.op)
        for i in attempts.order:
            body = attempts.settle(i, await self._call_one(i, c, timeout))
            if body is not None:
                return c.result(body, self.endpoints[i])
        raise attempts.exhausted()

    async def _call_one(self, i: int, c: Call[T], timeout: float) -> Reply | MasterError:
        """Ask master i once: its reply, or the MasterTimeout that ended the attempt (as a value: FailoverCall)."""
        sock = self._socks[i]
        if sock is None:
            sock = self._socks[i] = _socket(self._ctx, self.endpoints[i], self.auth)  # type: ignore[arg-type]
        reader = self._readers[i]
        if reader is None or reader.done():
            self._readers[i] = asyncio.create_task(self._read(sock))
        req_id = next(self._ids)
        fut: asyncio.Future[tuple[bool, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = fut
        try:
            await sock.send(wire.encode_request(req_id, c.op, c.body))
            ok, body = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self._timeout(c.op, i, timeout)
        finally:
            self._waiting.pop(req_id, None)
        self._answered[i] = True
        return ok, body

    async def _read(self, sock: Any) -> None:
        while True:
            frame = await sock.recv()
            try:
                rid, ok, body = wire.decode_reply(frame)
            except wire.WireError:
                continue  # not a reply we can match: every waiter times out rather than gets garbage
            fut = self._waiting.get(rid)
            if fut is not None and not fut.done():
                fut.set_result((ok, body))

    async def close(self) -> None:
        for reader in self._readers:
            if reader is not None:
                reader.cancel()
                try:
                    await reader
                except (asyncio.CancelledError, zmq.ZMQError):
                    pass
        for sock in self._socks:
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncMasterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- ops (one line each; the requests and results live in kvtier.client.api) -------------------------

    async def ping(self) -> dict[str, Any]:
        return await self.call(api.ping())

    async def lookup(self, keys: KeysLike, touch: bool = True) -> MasterLookup:
        return await self.call(api.lookup(keys, touch))

    async def cost(self, keys: KeysLike, candidates: Sequence[str], block_tokens: int,
                   prefill_tokens_per_s: float, prompt_tokens: int | None = None, touch: bool = True,
                   checkpoints: Sequence[tuple[int, KeysLike]] | None = None) -> CostResult:
        return await self.call(api.cost(keys, candidates, block_tokens, prefill_tokens_per_s, prompt_tokens, touch,
                                        checkpoints))

    async def route_put(self, sizes: Sequence[int], requester: str | None = None, keys: KeysLike | None = None,
                        policy: str | None = None, labels: Mapping[str, str] | None = None
                        ) -> list[tuple[str, str] | None]:
        return await self.call(api.route_put(sizes, requester, keys, policy, labels))

    async def locate(self, keys: KeysLike, labels: Mapping[str, str] | None = None,
                     touch: bool = True) -> LocateResult:
        return await self.call(api.locate(keys, labels, touch))

    async def heat(self, keys: KeysLike) -> HeatResult:
        return await self.call(api.heat(keys))

    async def top(self, n: int) -> TopResult:
        return await self.call(api.top(n))

    async def nodes(self) -> list[dict[str, Any]]:
        return await self.call(api.nodes())

    async def pin(self, keys: KeysLike | None = None, session: str | None = None, ttl_s: float = 0.0) -> int:
        return await self.call(api.pin(keys, session, ttl_s))

    async def unpin(self, keys: KeysLike | None = None, session: str | None = None) -> int:
        return await self.call(api.unpin(keys, session))

    async def priority(self, level: int, keys: KeysLike | None = None, session: str | None = None,
                       ttl_s: float = 0.0) -> int:
        return await self.call(api.priority(level, keys, session, ttl_s))

    async def hints(self, since: int = -1) -> MasterHints:
        return await self.call(api.hints(since))

    async def prefetch(self, node: str, keys: KeysLike | None = None, session: str | None = None,
                       ttl_s: float = 30.0) -> PrefetchResult:
        return await self.call(api.prefetch(node, keys, session, ttl_s))

    async def forget(self, node: str) -> bool:
        return await self.call(api.forget(node))


__all__ = ["AsyncMasterClient", "Failover", "MasterClient", "MasterError", "MasterTimeout", "MasterUnknownNode",
           "parse_endpoints"]
