"""The eviction policy protocol: which blocks to drop when a tier is full, and which new blocks to take in.

A policy tracks keys; the tier owns the bytes, the slots and the pins. All methods take batches, so a put of
2,000 blocks is one call. Policies are not thread-safe: the tier calls them under its own lock.

Keys-only policies (lru, fifo, s3fifo, arc) implement insert / access / remove / victims. Policies that use
what the engine knows (chains, agents, stop reasons: observations.py) also implement ``observe`` and
``admit``, and a predicting one ``predicted_back`` and ``prefetch_room`` (what a prefetch between turns may
evict: kvtier/prefetch/); ``Policy`` gives every method a default, so a policy overrides only what it uses. Time is read from
an injectable clock (``clock``, a callable returning seconds), never from the wall directly, so a replay runs
policies on its virtual clock and tests on a hand-moved one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import ClassVar, Protocol, runtime_checkable

from kvtier.policies.observations import Observations

Clock = Callable[[], float]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What a tier calls. ``capacity`` (in blocks) and ``clock`` are given at construction."""

    name: ClassVar[str]
    # True if ``observe`` uses what it is given: the store forwards observations only to such tiers.
    observes: ClassVar[bool]

    def insert(self, keys: Sequence[bytes]) -> None:
        """Start tracking newly stored keys (none of them is tracked yet), in any order."""

    def access(self, keys: Sequence[bytes]) -> None:
        """Record a hit on tracked keys; untracked keys are ignored."""

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking keys (removed by the caller); untracked keys are ignored."""

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        """Choose up to ``n`` tracked keys not in ``protected``, stop tracking them, and return them.

        Fewer than ``n`` are returned only when every other tracked key is protected.
        """

    def observe(self, batch: Observations) -> None:
        """Learn from arrivals, completions and hints (every one carries its session and time, filled in by
        the store). Keys may be unknown to the policy; it keeps no state per untracked key beyond a bound."""

    def admit(self, keys: Sequence[bytes], free: int) -> Sequence[int] | None:
        """Which of a put's new keys (none tracked, distinct) to store, when they do not fit in the ``free``
        slots: their positions in ``keys``, the most valuable (root-most) first; the tier stores them in that
        order, as far as slots and victims go. An empty list stores none, None all of them in batch order.
        Never drops a key the tier holds already: it only decides about new ones."""

    def predicted_back(self, session: str) -> float | None:
        """When the agent ``session`` is predicted to send its next request (the clock's seconds); None where
        the policy predicts nothing (keys-only policies, an agent it does not know, one not expected back)."""

    def handed_up(self, session: str, keys: Sequence[bytes], depths: Sequence[int]) -> None:
        """``keys`` (at ``depths`` of agent ``session``'s chain) just left this tier for the one above (a prefetch
        moved them up: kvtier/offload/). A policy that learns chains remembers they are the agent's, so that
        when they come back down (the tier above evicts them) they are admitted as its blocks, not as blocks
        of no known agent."""

    def prefetch_room(self, session: str, chain: Sequence[bytes], start: int, need: int, free: int) -> int:
        """How many of ``need`` blocks of agent ``session``'s chain (``chain``: its keys from depth ``start``
        on, root first) a prefetch may bring into the tier now: the ``free`` slots, plus what can be evicted
        without evicting a block predicted to be needed sooner than these (kvtier/prefetch/). A policy that
        learns chains claims the keys for the agent here, so the put that follows files them under it."""

    def __len__(self) -> int:
        """Number of tracked keys."""


class Policy:
    """Base class of kvtier's policies: no-op ``observe``, ``admit`` taking everything, and the clock.

    Subclasses implement insert / access / remove / victims / __len__ (see EvictionPolicy)."""

    name: ClassVar[str] = ""
    observes: ClassVar[bool] = False

    def __init__(self, capacity: int = 0, *, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity
        self.clock = clock

    def observe(self, batch: Observations) -> None:
        return None

    def admit(self, keys: Sequence[bytes], free: int) -> Sequence[int] | None:
        return None

    def predicted_back(self, session: str) -> float | None:
        return None

    def handed_up(self, session: str, keys: Sequence[bytes], depths: Sequence[int]) -> None:
        return None

    def prefetch_room(self, session: str, chain: Sequence[bytes], start: int, need: int, free: int) -> int:
        """The free slots only: a policy that predicts nothing has no way to tell that a prefetched block is
        needed sooner than the one it would evict, so it evicts nothing for a prefetch."""
        return max(0, min(need, free))


def take_oldest(queue: OrderedDict[bytes, None], n: int, protected: Container[bytes], out: list[bytes]) -> None:
    """Evict from the old end of ``queue`` (oldest first) into ``out`` until ``out`` holds ``n`` keys: an
    unprotected key leaves the queue and is appended, a protected one moves to the young end (it is in use, so
    "recently used" is honest, and the next call does not scan it again). Each key is looked at once per call:
    a queue whose keys are all protected is scanned once, not cycled.

    The one scan of LRU's (and so FIFO's and chain-lru's) victims and of PNU's queues of keys of no agent; ARC
    and S3-FIFO scan two queues at once, with their own rules for a protected key, and keep their own loops."""
    move = queue.move_to_end
    for _ in range(len(queue)):
        if len(out) >= n:
            break
        key = next(iter(queue))
        if key in protected:
            move(key)
        else:
            del queue[key]
            out.append(key)


class KeysOnly(Policy):
    """Adapts a policy class written to the keys-only protocol (insert / access / remove / victims / len, no
    ``observe`` or ``admit``; e.g. a user's ``pkg.mod:Class`` from before observations existed)."""

    def __init__(self, inner: object) -> None:
        super().__init__(0)
        self.inner = inner
        self.name = str(getattr(type(inner), "name", type(inner).__qualname__))  # type: ignore[misc]

    def insert(self, keys: Sequence[bytes]) -> None:
        self.inner.insert(keys)  # type: ignore[attr-defined]

    def access(self, keys: Sequence[bytes]) -> None:
        self.inner.access(keys)  # type: ignore[attr-defined]

    def remove(self, keys: Sequence[bytes]) -> None:
        self.inner.remove(keys)  # type: ignore[attr-defined]

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        return self.inner.victims(n, protected)  # type: ignore[attr-defined,no-any-return]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]
