"""Where a PoolTier puts blocks and where it looks for them: a static list of pools, or kvtier-master.

* ``PeerRoute(endpoints)``: no master. Each key belongs to one pool by rendezvous hashing over the pools that
  are up (with one pool, everything goes there). Gets ask the pool the key hashes to; a key put while its
  pool was down sits on the next-ranked pool and is a miss once its own pool is back (a miss, never wrong).
* ``MasterRoute(master, requester)``: kvtier-master places (``route_put`` among nodes labelled role=pool, so
  engines' own DRAM is never a target) and finds (``locate``: per key, a live pool holding it). Its answers
  are the directory, so ``contains`` needs no round trip to the pools. ``master`` may list several masters of
  one shared directory ("tcp://a:7300,tcp://b:7300"): the client fails over between them by itself
  (kvtier/client/master.py), and only when none answers is the route put in a back-off (``MasterBackoff``:
  0.5 s doubling to 30 s, reset by the next answer): calls inside it fail at once (the tier turns them into misses) instead of each waiting out the timeout, so a store whose master is
  down still serves its DRAM and SSD hits at full speed.

Both are thread-safe. A route names pools by endpoint; the tier owns the connections.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from kvtier import wire
from kvtier.backoff import Backoff, Clock
from kvtier.keys import rendezvous_order
from kvtier.transport.base import PoolUnavailable
from kvtier.wire.pool import POOL_LABELS

log = logging.getLogger(__name__)

T = TypeVar("T")
MASTER_BACKOFF_S = (0.5, 30.0)  # first and longest back-off after kvtier-master fails to answer
REFRESH_S = 10.0  # endpoints(fresh=True): how stale the master's list of pools may be (one nodes call per this)
Up = Callable[[str], bool]  # is this pool usable now (not in its back-off after a failure)?


class PoolRoute(Protocol):
    authoritative: bool  # locate() answers from a directory: a key it does not name is not held

    def place(self, keys: Sequence[bytes], block_bytes: int, up: Up) -> list[str | None]:
        """The pool each new block should go to (None: no pool has room or is up)."""

    def locate(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        """The pool to ask for each key (None: no pool holds it)."""

    def endpoints(self, *, fresh: bool = False) -> list[str]:
        """Every pool this route knows now; ``fresh``: every pool there is, as of at most REFRESH_S ago (the
        pools observations go to: a pool this process has not used yet evicts by what its engines tell it)."""

    def stats(self) -> dict[str, Any]:
        """Counters of the route itself (the master's health and back-off); empty for a static route."""

    def describe(self) -> str:
        """Where pools come from, for a person reading a log line."""

    def close(self) -> None: ...


class PeerRoute:
    """A static list of pool endpoints, placement by rendezvous hashing of keys over the ones that are up."""

    authoritative = False

    def __init__(self, endpoints: Sequence[str]) -> None:
        if not endpoints:
            raise ValueError("a pool route needs at least one pool endpoint")
        self._endpoints = list(dict.fromkeys(endpoints))

    def place(self, keys: Sequence[bytes], block_bytes: int, up: Up) -> list[str | None]:
        return self._owners(keys, up)

    def locate(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        return self._owners(keys, up)

    def _owners(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        live = [e for e in self._endpoints if up(e)]
        if len(live) <= 1:
            return [live[0] if live else None] * len(keys)
        first = rendezvous_order(np.frombuffer(wire.pack_keys(keys), "<u8").reshape(-1, 2), live)[:, 0]
        return [live[i] for i in first.tolist()]

    def endpoints(self, *, fresh: bool = False) -> list[str]:
        return list(self._endpoints)

    def stats(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return f"the pools listed in 'pool': {', '.join(self._endpoints)}"

    def close(self) -> None:
        pass


class MasterBackoff:
    """Runs calls to kvtier-master one at a time, and fails them at once while the master is in its back-off.

    A call that raises MasterTimeout (no answer) starts a back-off (``first_s``, doubling per failure up to
    ``max_s``); any answer, even an error reply, ends it. While the master is down, calls raise PoolUnavailable
    (code "backoff") at once, without touching the socket: when a back-off has run out, ``probe`` (a cheap
    master call, e.g. ping) asks the master again on a thread of its own, so no caller (a get that must look
    past the pool for an SSD hit) ever waits out a timeout for a master known to be down. Without a ``probe``
    the first caller after the back-off asks instead (and waits). Callers that queued behind a call that then
    failed fail with it instead of each waiting out their own timeout in turn. The state change (down,
    answering again) is logged once; ``stats()`` counts calls, failures and calls skipped. Thread-safe.
    """

    def __init__(self, master: str, first_s: float = MASTER_BACKOFF_S[0], max_s: float = MASTER_BACKOFF_S[1], *,
                 probe: Callable[[], Any] | None = None, clock: Clock = time.monotonic) -> None:
        self.master = master
        self.first_s, self.max_s = first_s, max_s
        self._probe = probe
        self._probing = False
        self._cond = threading.Condition()
        self._busy = False
        self._health = Backoff(first_s, max_s, clock=clock)  # updated under _cond
        self._last_error = ""
        self._failures = 0  # master calls that got no answer (also the generation waiters compare)
        self._calls = 0
        self._skipped = 0

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (a call on the master client), or PoolUnavailable if the master is not answering."""
        with self._cond:
            generation = self._failures
            mine = False
            while True:
                left = self._health.left_s()
                if self._failures != generation or left > 0:  # failed with the call it queued behind, or waits
                    break
                if self._health.failing and self._probe is not None:  # back-off over: the probe asks, this caller goes on
                    self._start_probe(self._probe)
                    break
                if not self._busy:
                    self._busy = mine = True
                    self._calls += 1
                    break
                self._cond.wait()
            if not mine:
                self._skipped += 1
                error = self._last_error
        if mine:
            return self._run(fn, what)
        raise PoolUnavailable(self.master, f"the master is not answering ({error}); {what} skipped, retrying in "
                                           f"{left:.1f} s", "backoff")

    def _start_probe(self, probe: Callable[[], Any]) -> None:
        """(lock held) Ask the master again on a thread of its own, unless a probe is already asking."""
        if not self._probing:
            self._probing = True
            threading.Thread(target=self._run_probe, args=(probe,), name="kvtier-master-probe", daemon=True).start()

    def _run_probe(self, probe: Callable[[], Any]) -> None:
        try:
            with self._cond:
                self._cond.wait_for(lambda: not self._busy)
                self._busy = True
                self._calls += 1
            self._run(probe, "answer a probe")
        except PoolUnavailable:
            pass  # still down: _failed logged it once and began the next back-off
        finally:
            with self._cond:
                self._probing = False

    def _run(self, fn: Callable[[], T], what: str) -> T:
        """Call ``fn`` (this thread holds ``_busy``) and update the back-off from how the master answered."""
        from kvtier.client import MasterError, MasterTimeout

        answered = False
        try:
            result = fn()
            answered = True
            return result
        except MasterTimeout as e:
            self._failed(str(e))
            raise PoolUnavailable(self.master, f"the master cannot {what}: {e}", "master") from None
        except MasterError as e:  # the master answered, with an error: it is up
            answered = True
            raise PoolUnavailable(self.master, f"the master cannot {what}: {e}", "master") from None
        finally:
            with self._cond:
                self._busy = False
                if answered and self._health.answered():
                    log.info("kvtier-master %s is answering again; pool lookups and placements resume", self.master)
                self._cond.notify_all()

    def _failed(self, error: str) -> None:
        with self._cond:
            self._failures += 1
            self._last_error = error
            if self._health.failed():
                log.warning("kvtier-master %s is not answering (%s); pool blocks are misses and puts skip the pool, "
                            "retrying after a back-off of %.1f s growing to %.0f s", self.master, error,
                            self._health.current_s, self.max_s)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"master": self.master, "up": not self._health.failing, "calls": self._calls,
                    "failures": self._failures, "skipped": self._skipped, "backoff_s": self._health.current_s,
                    "backoff_left_s": self._health.left_s(),
                    "last_error": self._last_error}


class MasterRoute:
    """kvtier-master's placements and directory (``master``: one endpoint, or several of a shared directory,
    comma-separated). ``requester`` is this node's id (the local_first policy
    places on the requester when it is a pool itself); ``backoff_s``: the first and longest back-off after
    the master fails to answer; ``auth_dir``: CurveZMQ keys for a master started with --auth-dir."""

    authoritative = True

    def __init__(self, master: str, requester: str, timeout_s: float = 0.5,
                 backoff_s: tuple[float, float] = MASTER_BACKOFF_S, auth_dir: str = "") -> None:
        from kvtier.auth import ClientKeys
        from kvtier.client import MasterClient

        self.master = master
        self.requester = requester
        auth = ClientKeys.load(auth_dir, master) if auth_dir else None  # AuthError: a setup error, now
        self._client = MasterClient(master, timeout_s, auth=auth)
        self._backoff = MasterBackoff(master, *backoff_s, probe=self._client.ping)
        self._address: dict[str, str] = {}  # node id -> endpoint
        self._refreshed = -REFRESH_S  # when endpoints(fresh=True) last asked the master for every pool (never)
        self._refreshing = threading.Lock()
        self._lock = threading.Lock()

    def place(self, keys: Sequence[bytes], block_bytes: int, up: Up) -> list[str | None]:
        targets = self._backoff.call(
            lambda: self._client.route_put([block_bytes] * len(keys), self.requester, keys, labels=POOL_LABELS),
            "place blocks")
        with self._lock:
            unknown = {t[0] for t in targets if t is not None and t[0] not in self._address}
        if unknown:
            self._refresh()
        out = [self._address.get(t[0]) if t is not None else None for t in targets]
        return [e if e is not None and up(e) else None for e in out]

    def locate(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        found = self._backoff.call(lambda: self._client.locate(keys, labels=POOL_LABELS), "locate blocks")
        with self._lock:
            for node, _tier, address in found.holders:
                self._address[node] = address
        return [found.holders[w][2] if w >= 0 else None for w in found.where]

    def endpoints(self, *, fresh: bool = False) -> list[str]:
        if fresh and time.monotonic() - self._refreshed >= REFRESH_S:
            with self._refreshing:  # a second caller waits for the list the first is asking for
                if time.monotonic() - self._refreshed >= REFRESH_S:
                    try:
                        self._refresh()
                    except PoolUnavailable:
                        pass  # the master is down (its back-off logged it): the pools known so far
                    finally:
                        self._refreshed = time.monotonic()  # answered or not: the next ask is REFRESH_S away
        with self._lock:
            return sorted(set(self._address.values()))

    def stats(self) -> dict[str, Any]:
        return self._backoff.stats()

    def describe(self) -> str:
        return f"pools registered with kvtier-master {self.master} (labels {POOL_LABELS})"

    def _refresh(self) -> None:
        nodes = self._backoff.call(self._client.nodes, "list the pools")
        with self._lock:
            for n in nodes:
                if n.get("labels", {}).get("role") == POOL_LABELS["role"] and n.get("address"):
                    self._address[n["node"]] = n["address"]

    def close(self) -> None:
        self._client.close()
