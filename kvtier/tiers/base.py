"""The Tier protocol: what TieredStore needs from each level below the engine's HBM.

Tiers are an ordered list in the store (DRAM first, then the remote pool, then the SSD), so a new tier slots in
without changing the store's callers. Every method is batch-first and thread-safe; ``put`` and ``get`` block
the calling thread until the bytes are copied (the store runs them on its I/O threads for the async calls).

What a tier can do beyond ``Tier`` is declared by the classes it derives from, never found by probing for a
method: ``AddressableSlots`` (host-memory slots a caller fills or reads in place: DramTier),
``WriteBehindStaging`` (stages blocks and writes them in the background: DiskTier, PoolTier), ``RemoteTier``
(its blocks live in other processes: PoolTier) and ``ListsKeys`` (lists every key it holds: DramTier, DiskTier).
The store and its offloaders check them once when built; the store answers its callers' questions about them
(``TieredStore.capacity_blocks``, ``pinned_memory``, ``local_tiers``, ``local_keys``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvtier.pins import PinTable
from kvtier.policies.observations import Observations

# Called with the keys a tier evicts and read-only views of their bytes, before the space is reused, so
# the store can demote them to the next tier. The views are valid only during the call. DramTier calls it with
# its lock released (a demotion may write to a disk or a pool, a listener may ask a master); it must not call
# the tier's remove for those keys (remove waits for their hand-down to end).
EvictListener = Callable[[Sequence[bytes], Sequence[Any]], None]


@dataclass
class TierStats:
    """Counters every tier reports (``extra`` holds tier-specific ones, e.g. checksum failures)."""

    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    evictions: int = 0
    rejected: int = 0  # puts refused: no evictable space, or the tier stopped admitting
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Tier(Protocol):
    """One level of the store. ``name`` is what lookups report ("dram", "pool", "ssd")."""

    name: str
    block_bytes: int

    def contains(self, keys: Sequence[bytes]) -> list[bool] | np.ndarray:
        """Which keys this tier holds now (a block being written is not held yet): a bool per key, as a list or
        a numpy bool array (DramTier's, from one native probe pass; the store merges either with numpy)."""

    def put(self, keys: Sequence[bytes], blocks: Any) -> list[bool]:
        """Store blocks; True where the key is held afterwards (stored now or already there).

        ``blocks``: one block per key (see kvtier.blocks). False means refused (no evictable space, or the
        tier stopped admitting); the caller may try elsewhere. Bytes are copied before this returns.
        """

    def get(self, keys: Sequence[bytes], out: Any) -> list[bool]:
        """Copy held blocks into ``out`` (one writable block per key); True where a block was copied."""

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop keys; return how many were held."""

    def attach(self, pins: PinTable, on_evict: EvictListener | None) -> None:
        """Give the tier the store's pin table (never evict a pinned key) and its eviction listener."""

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


@runtime_checkable
class ObservingTier(Protocol):
    """A tier whose eviction policy can learn from what the engine knows (TieredStore.observe forwards to it
    while ``observes`` is True): the DRAM and SSD tiers."""

    observes: bool

    def observe(self, batch: Observations) -> None:
        """Pass a resolved batch (sessions and times filled in) to the policy, under the tier's lock."""


@runtime_checkable
class PrefetchTarget(Protocol):
    """A tier a prefetch between turns can bring blocks up into (kvtier/prefetch/): its policy says when an
    agent is predicted back and how much room a prefetch may take without evicting what is needed sooner (the
    DRAM tier)."""

    def predicted_back(self, sessions: Sequence[str]) -> list[float | None]:
        """Per session, when its agent is predicted back on the store's clock (None: no prediction)."""

    def prefetch_room(self, session: str, chain: Sequence[bytes], start: int, need: int) -> int:
        """How many of ``need`` blocks of the agent's chain (keys from depth ``start``) may be brought in now."""


@runtime_checkable
class HandsUp(Protocol):
    """A private lower tier a prefetch may move blocks out of, into the tier above (the SSD: kvtier/offload/
    says when). A shared one (a pool other engines read) keeps its copy."""

    def hand_up(self, keys: Sequence[bytes], session: str, depths: Sequence[int]) -> None:
        """Drop ``keys`` (the tier above holds them now), telling the policy they are agent ``session``'s, at
        ``depths`` of its chain (EvictionPolicy.handed_up)."""


@dataclass
class Reservation:
    """Slots reserved for keys by ``AddressableSlots.reserve``; hand it back to ``commit`` exactly once.

    ``held[i]`` is True where key i is held after the put (already stored, in flight elsewhere, or reserved
    here); ``index[j]`` is the position in the caller's batch of the j-th reserved slot, ``addresses[j]`` its
    host address (the caller writes the block there between reserve and commit).
    """

    held: list[bool]
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    addresses: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))


class ListsKeys(ABC):
    """Declares a tier that can list every key it holds, from its own memory or disk (DramTier, DiskTier): a
    node's inventory for the master, a clear of one server's blocks."""

    @abstractmethod
    def keys(self) -> list[bytes]:
        """Every key held now (a snapshot)."""


class AddressableSlots(ListsKeys):
    """Declares a tier whose blocks sit in fixed-size slots of host memory a caller can address (DramTier); it
    lists its keys too (a closing store reads them in place to write them down: kvtier/offload/).

    Two-phase writes: ``reserve`` takes slots and returns their addresses, the caller fills them, ``commit``
    publishes the keys (or gives the slots back). Zero-copy reads: ``acquire`` lends the addresses of held
    blocks until its context exits (nothing evicts or reuses them meanwhile). The store's ``put_in_place`` and
    ``borrow`` work only over a top tier that declares this; the pool daemon receives bytes straight into them.
    """

    @abstractmethod
    def reserve(self, keys: Sequence[bytes], protect: Sequence[bytes] = ()) -> Reservation:
        """Take a slot for each key not held or in flight (never evicting a block of ``keys`` or ``protect``)."""

    @abstractmethod
    def commit(self, res: Reservation, success: bool = True) -> None:
        """Publish the reserved keys (or, with success=False, give their slots back)."""

    @abstractmethod
    def put_new(self, keys: Sequence[bytes], blocks: Any) -> list[int]:
        """``put`` of keys the caller found missing: the positions (ascending) of those it stored now. A key
        held meanwhile (as ``contains`` would say) is left as it is; asked in the step that takes the slots, so
        the caller does not ask ``contains`` first (the store's promotion of what a lower tier served)."""

    @abstractmethod
    def acquire(self, keys: Sequence[bytes]) -> AbstractContextManager[list[int | None]]:
        """Addresses of held blocks (None for misses), readable until the context exits."""

    @property
    @abstractmethod
    def pinned(self) -> bool:
        """Whether the slots' memory is page-locked: a GPU copies to and from it directly over PCIe."""


class WriteBehindStaging(ABC):
    """Declares a tier that can take blocks without the caller waiting for its device or network: ``put_later``
    copies them into the tier's own staging memory before it returns (the caller's buffer is free at once)
    and writes them in the background (DiskTier, PoolTier). The store's offloaders use it instead of ``put``."""

    @abstractmethod
    def put_later(self, keys: Sequence[bytes], blocks: Any, *, wait: bool) -> Future[list[bytes]] | None:
        """Stage the blocks now, write them later; the Future gives the keys the tier then holds. Without
        ``wait`` blocks that find no staging memory are dropped; None when the tier does not admit at all."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block staged so far is written (or failed); False on timeout."""


class RemoteTier(ABC):
    """Declares a tier whose blocks live in other processes (the kvtier-pool daemons, PoolTier): its
    ``contains`` may be a network round trip, so offloads ask ``held_locally`` instead, and a node's agent
    does not report the tier's blocks as the node's own (the pools report them)."""

    @abstractmethod
    def held_locally(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys this process knows the tier holds without asking it (sent or fetched recently)."""
