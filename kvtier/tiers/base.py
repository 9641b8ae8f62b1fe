"""The Tier protocol: what TieredStore needs from each level below the engine's HBM.

Tiers are an ordered list in the store (DRAM first, then SSD, then the remote pool), so a new tier slots in
without changing the store's callers. Every method is batch-first and thread-safe; ``put`` and ``get`` block
the calling thread until the bytes are copied (the store runs them on its I/O threads for the async calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvtier.pins import PinTable
from kvtier.policies.observations import Observations

# Called with the keys a tier evicts and read-only views of their bytes, before the space is reused, so
# the store can demote them to the next tier. The views are valid only during the call.
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
    """One level of the store. ``name`` is what lookups report ("dram", "ssd", "pool")."""

    name: str
    block_bytes: int

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys this tier holds now (a block being written is not held yet)."""

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
