"""Which kvtier-master a client asks, and what a call's failure means: the errors, the failover order and one
call's walk over the masters. No I/O (sans-I/O, as kvtier.client.api): MasterClient and AsyncMasterClient
(kvtier/client/master.py) do the socket work and report each outcome here, so both fail over by one code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier import wire
from kvtier.backoff import Backoff, Clock

# What one master's attempt gave: (ok, body) of its reply, or the MasterError that ended it (a timeout, an
# unreadable reply), as a value, so the walk below is one function for the blocking and the asyncio client.
Reply = tuple[bool, dict[str, Any]]


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


def error_of(body: Mapping[str, Any]) -> MasterError:
    code = str(body.get("code", wire.ERR_INTERNAL))
    cls = MasterUnknownNode if code == wire.ERR_UNKNOWN_NODE else MasterError
    return cls(code, str(body.get("message", "")))


FAILOVER_BACKOFF_S = (0.5, 30.0)  # a master that failed a call is asked again after this (doubling), or last


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """Master endpoints from "tcp://a:7300,tcp://b:7300" or a sequence; at least one."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = list(dict.fromkeys(e.strip() for e in items if e and e.strip()))
    if not out:
        raise ValueError(f"no master endpoint in {endpoints!r}")
    return out


class Failover:
    """Which of a client's masters to ask, in what order: the one that answered last first, then the others not
    in a back-off, in the order given (all of them in back-off: the one whose back-off ends first). Thread-safe
    (a lock); with one master, always that one (a back-off is then the caller's business, as before)."""

    def __init__(self, endpoints: list[str], backoff_s: tuple[float, float] = FAILOVER_BACKOFF_S,
                 clock: Clock = time.monotonic) -> None:
        self.endpoints = endpoints
        self.preferred = 0
        self._health = [Backoff(*backoff_s, clock=clock) for _ in endpoints]
        self._lock = threading.Lock()
        self.failovers = 0  # calls answered by another master than the one asked first

    def order(self) -> list[int]:
        if len(self.endpoints) == 1:
            return [0]
        with self._lock:
            rest = [i for i in range(len(self.endpoints)) if i != self.preferred]
            up = [i for i in [self.preferred, *rest] if self._health[i].up()]
            return up or [min(range(len(self.endpoints)), key=lambda i: self._health[i].down_until)]

    def answered(self, i: int, first: int) -> None:
        with self._lock:
            if i != first:
                self.failovers += 1
            self.preferred = i
            self._health[i].answered()

    def failed(self, i: int) -> None:
        with self._lock:
            self._health[i].failed()


class FailoverCall:
    """One call's walk over the masters, without I/O: MasterClient and AsyncMasterClient ask the masters in
    ``order`` and report each outcome here, which decides whether the call ends (an answer, or an error another
    master would give too) or goes on to the next master, and keeps ``failover`` told."""

    def __init__(self, failover: Failover, op: str) -> None:
        self.failover = failover
        self.op = op
        self.order = failover.order()
        self.errors: list[MasterError] = []

    def settle(self, i: int, outcome: Reply | MasterError) -> dict[str, Any] | None:
        """Master i's ``outcome``: the body of an answer to return, or None to ask the next master in ``order``;
        raises where no other master would serve the call (an error reply, or a failure, that every one gives)."""
        if isinstance(outcome, MasterError):
            self.failed(i, outcome)
            return None
        ok, body = outcome
        return body if self.replied(i, ok, body) else None

    def replied(self, i: int, ok: bool, body: Mapping[str, Any]) -> bool:
        """Master i replied: True for an answer to return; an error reply raises, or is False where the next
        master may serve the call."""
        if ok:
            self.failover.answered(i, self.order[0])
            return True
        self.failed(i, error_of(body))
        return False

    def failed(self, i: int, e: MasterError) -> None:
        """Master i failed the call with ``e``: raised where another master would not serve it either (only
        one that did not answer, or cannot record writes now, is worth asking the next)."""
        if not (isinstance(e, MasterTimeout) or e.code == wire.ERR_UNAVAILABLE):
            self.failover.answered(i, self.order[0])
            raise e
        self.failover.failed(i)
        self.errors.append(e)

    def exhausted(self) -> MasterError:
        """The error to raise once every master in ``order`` failed the call: its own where one was asked."""
        if len(self.errors) == 1:
            return self.errors[0]
        text = "; ".join(str(e) for e in self.errors)
        if all(isinstance(e, MasterTimeout) for e in self.errors):
            return MasterTimeout("timeout", f"{self.op}: no master served it: {text}")
        return MasterError(wire.ERR_UNAVAILABLE, f"{self.op}: no master served it: {text}")


__all__ = ["FAILOVER_BACKOFF_S", "Failover", "FailoverCall", "MasterError", "MasterTimeout", "MasterUnknownNode",
           "Reply", "error_of", "parse_endpoints"]
