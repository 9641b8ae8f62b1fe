"""GuardedPolicy: a policy that raises never breaks a put or a get; the tier goes on in LRU order.

A tier wraps its policy in one. The first exception out of any call is logged once, with its traceback and the
policy's name; from then on an LRU policy holding every key the tier holds (``held()``, read from the tier's
own map, in no particular order) takes over, and the failed policy is never called again. What the failing
call was doing is redone by the LRU: a ``victims`` call is answered by it, an ``insert`` or ``remove`` is
already reflected in the tier's map (the tier updates its map before telling the policy), ``observe`` and
``admit`` are dropped (admit: every new key is stored), ``predicted_back`` and ``prefetch_room`` are
answered by the LRU (no prediction: a prefetch gets the free slots only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Sequence

from kvtier.policies.base import Policy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.observations import Observations

log = logging.getLogger(__name__)


class GuardedPolicy(Policy):
    """Wraps ``policy`` for a tier whose keys ``held()`` lists (called under the tier's lock, like every
    method here). Not thread-safe, as every policy."""

    def __init__(self, policy: Policy, held: Callable[[], Iterable[bytes]], where: str = "tier") -> None:
        super().__init__(policy.capacity, clock=policy.clock)
        self.policy: Policy = policy
        self.name = policy.name  # type: ignore[misc]
        self.observes = policy.observes  # type: ignore[misc]
        self.failed: str | None = None  # what the policy raised, once it has
        self._held = held
        self._where = where

    def insert(self, keys: Sequence[bytes]) -> None:
        try:
            self.policy.insert(keys)
        except Exception as e:
            self._fail("insert", e)

    def access(self, keys: Sequence[bytes]) -> None:
        try:
            self.policy.access(keys)
        except Exception as e:
            self._fail("access", e)

    def remove(self, keys: Sequence[bytes]) -> None:
        try:
            self.policy.remove(keys)
        except Exception as e:
            self._fail("remove", e)

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        try:
            return self.policy.victims(n, protected)
        except Exception as e:
            self._fail("victims", e)
            return self.policy.victims(n, protected)

    def observe(self, batch: Observations) -> None:
        try:
            self.policy.observe(batch)
        except Exception as e:
            self._fail("observe", e)

    def admit(self, keys: Sequence[bytes], free: int) -> Sequence[int] | None:
        try:
            return self.policy.admit(keys, free)
        except Exception as e:
            self._fail("admit", e)
            return None

    def predicted_back(self, session: str) -> float | None:
        try:
            return self.policy.predicted_back(session)
        except Exception as e:
            self._fail("predicted_back", e)
            return None

    def handed_up(self, session: str, keys: Sequence[bytes], depths: Sequence[int]) -> None:
        try:
            self.policy.handed_up(session, keys, depths)
        except Exception as e:
            self._fail("handed_up", e)

    def prefetch_room(self, session: str, chain: Sequence[bytes], start: int, need: int, free: int) -> int:
        try:
            return self.policy.prefetch_room(session, chain, start, need, free)
        except Exception as e:
            self._fail("prefetch_room", e)
            return self.policy.prefetch_room(session, chain, start, need, free)

    def __len__(self) -> int:
        try:
            return len(self.policy)
        except Exception as e:
            self._fail("len", e)
            return len(self.policy)

    def _fail(self, call: str, error: Exception) -> None:
        name = self.policy.name or type(self.policy).__qualname__
        self.failed = f"{name}.{call}: {type(error).__name__}: {error}"
        log.error("eviction policy %r of the %s raised in %s; the %s evicts in LRU order from now on",
                  name, self._where, call, self._where, exc_info=error)
        lru = LRUPolicy(self.capacity, clock=self.clock)
        lru.insert(list(self._held()))
        self.policy = lru
        self.observes = False  # type: ignore[misc]
