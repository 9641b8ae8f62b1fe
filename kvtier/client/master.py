"""MasterClient (blocking) and AsyncMasterClient (asyncio): talk to kvtier-master over one zmq DEALER socket.

    with MasterClient("tcp://master:7300") as m:
        hit = m.lookup(keys)                         # LookupResult: leading blocks per node and tier
        plans = m.cost(keys, ["w1", "w2"], block_tokens=64, prefill_tokens_per_s=20_000).plans

Every call has a timeout (``timeout_s``); a call that times out raises MasterTimeout, and the sync client
rebuilds its socket so the next call starts clean. zmq reconnects by itself when the master restarts on the
same endpoint. A reply to an earlier, timed-out request is recognised by its req_id and dropped. An error
reply raises MasterError with the daemon's code and message (MasterUnknownNode for ERR_UNKNOWN_NODE; an op
the client's key has no role for is ERR_FORBIDDEN, its message naming the role it needs).

With ``auth`` (kvtier.auth.ClientKeys, for a master started with --auth-dir) the socket is a CurveZMQ
client. A master that refuses the keys, or wants keys the client lacks, stays silent: a timeout before any
reply says that this may be why.

MasterClient: thread-safe (one lock; calls are serialised on its socket). AsyncMasterClient: for one event
loop; many calls may be in flight at once, matched to replies by req_id. Both own their socket; close() them.
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
from kvtier.auth import ClientKeys, silence_hint
from kvtier.client import api
from kvtier.client.api import Call, CostResult, HeatResult, Hints, KeysLike, LocateResult, LookupResult, TopResult

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 2.0


class MasterError(RuntimeError):
    """The master answered with an error (``code`` is one of kvtier.wire.ERR_*), or could not be reached."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class MasterTimeout(MasterError):
    """No reply within the timeout (master down, overloaded, or unreachable)."""


class MasterUnknownNode(MasterError):
    """A node op from a node the master does not know: register again."""


def _error(body: Mapping[str, Any]) -> MasterError:
    code = str(body.get("code", wire.ERR_INTERNAL))
    cls = MasterUnknownNode if code == wire.ERR_UNKNOWN_NODE else MasterError
    return cls(code, str(body.get("message", "")))


def _socket(ctx: zmq.Context[Any], endpoint: str, auth: ClientKeys | None) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if auth is not None:
        auth.apply(sock)
    sock.connect(endpoint)
    return sock


def _timeout(op: str, endpoint: str, timeout: float, answered: bool, auth: ClientKeys | None) -> MasterTimeout:
    hint = "" if answered else silence_hint(endpoint, auth)
    return MasterTimeout("timeout", f"{op} to {endpoint}: no reply within {timeout:g} s{hint}")


class MasterClient:
    """Blocking client. ``endpoint`` like "tcp://127.0.0.1:7300"."""

    def __init__(self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, auth: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.auth = auth
        self._answered = False  # any reply yet (a silence before the first one may be refused keys)
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, endpoint, auth)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.last_rtt_s = 0.0  # round trip of the last successful call (the node agent's latency signal)

    def call(self, c: Call[T], timeout_s: float | None = None) -> T:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            req_id = next(self._ids)
            t0 = time.perf_counter()
            self._sock.send(wire.encode_request(req_id, c.op, c.body))
            deadline = t0 + timeout
            while True:
                left = deadline - time.perf_counter()
                if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                    self._reset()
                    raise _timeout(c.op, self.endpoint, timeout, self._answered, self.auth)
                try:
                    rid, ok, body = wire.decode_reply(self._sock.recv())
                except wire.WireError as e:
                    self._reset()
                    raise MasterError(e.code, f"{c.op}: unreadable reply from {self.endpoint}: {e.message}") from None
                if rid == req_id:
                    break  # other ids: late replies to requests that timed out
            self.last_rtt_s = time.perf_counter() - t0
            self._answered = True
        if not ok:
            raise _error(body)
        return c.parse(body)

    def _reset(self) -> None:
        """Drop the socket (and whatever it had queued for a dead master) and connect a fresh one."""
        self._sock.close(linger=0)
        self._sock = _socket(self._ctx, self.endpoint, self.auth)

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- ops (see kvtier.client.api for what each sends and returns) -------------------------------------

    def ping(self) -> dict[str, Any]:
        return self.call(api.ping())

    def lookup(self, keys: KeysLike, touch: bool = True) -> LookupResult:
        return self.call(api.lookup(keys, touch))

    def cost(self, keys: KeysLike, candidates: Sequence[str], block_tokens: int, prefill_tokens_per_s: float,
             prompt_tokens: int | None = None, touch: bool = True) -> CostResult:
        return self.call(api.cost(keys, candidates, block_tokens, prefill_tokens_per_s, prompt_tokens, touch))

    def route_put(self, sizes: Sequence[int], requester: str | None = None, keys: KeysLike | None = None,
                  policy: str | None = None, labels: Mapping[str, str] | None = None
                  ) -> list[tuple[str, str] | None]:
        return self.call(api.route_put(sizes, requester, keys, policy, labels))

    def locate(self, keys: KeysLike, labels: Mapping[str, str] | None = None) -> LocateResult:
        return self.call(api.locate(keys, labels))

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

    def hints(self, since: int = -1) -> Hints:
        return self.call(api.hints(since))

    def forget(self, node: str) -> bool:
        return self.call(api.forget(node))


class AsyncMasterClient:
    """asyncio client for one event loop. Calls may overlap; each waits at most ``timeout_s``."""

    def __init__(self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, auth: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.auth = auth
        self._answered = False
        self._ctx = zmq.asyncio.Context()
        self._sock = _socket(self._ctx, endpoint, auth)  # type: ignore[arg-type]
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[bool, dict[str, Any]]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(self, c: Call[T], timeout_s: float | None = None) -> T:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        timeout = self.timeout_s if timeout_s is None else timeout_s
        req_id = next(self._ids)
        fut: asyncio.Future[tuple[bool, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = fut
        try:
            await self._sock.send(wire.encode_request(req_id, c.op, c.body))
            ok, body = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            # The hint's port probe (0.2 s at most, only without keys and before any reply) runs off the loop.
            raise await asyncio.to_thread(_timeout, c.op, self.endpoint, timeout, self._answered, self.auth) from None
        finally:
            self._waiting.pop(req_id, None)
        self._answered = True
        if not ok:
            raise _error(body)
        return c.parse(body)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                rid, ok, body = wire.decode_reply(frame)
            except wire.WireError:
                continue  # not a reply we can match: every waiter times out rather than gets garbage
            fut = self._waiting.get(rid)
            if fut is not None and not fut.done():
                fut.set_result((ok, body))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, zmq.ZMQError):
                pass
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncMasterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- ops (one line each; the requests and results live in kvtier.client.api) -------------------------

    async def ping(self) -> dict[str, Any]:
        return await self.call(api.ping())

    async def lookup(self, keys: KeysLike, touch: bool = True) -> LookupResult:
        return await self.call(api.lookup(keys, touch))

    async def cost(self, keys: KeysLike, candidates: Sequence[str], block_tokens: int,
                   prefill_tokens_per_s: float, prompt_tokens: int | None = None, touch: bool = True) -> CostResult:
        return await self.call(api.cost(keys, candidates, block_tokens, prefill_tokens_per_s, prompt_tokens, touch))

    async def route_put(self, sizes: Sequence[int], requester: str | None = None, keys: KeysLike | None = None,
                        policy: str | None = None, labels: Mapping[str, str] | None = None
                        ) -> list[tuple[str, str] | None]:
        return await self.call(api.route_put(sizes, requester, keys, policy, labels))

    async def locate(self, keys: KeysLike, labels: Mapping[str, str] | None = None) -> LocateResult:
        return await self.call(api.locate(keys, labels))

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

    async def hints(self, since: int = -1) -> Hints:
        return await self.call(api.hints(since))

    async def forget(self, node: str) -> bool:
        return await self.call(api.forget(node))


__all__ = ["AsyncMasterClient", "MasterClient", "MasterError", "MasterTimeout", "MasterUnknownNode"]
