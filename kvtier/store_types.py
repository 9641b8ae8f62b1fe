"""What TieredStore's calls return and announce: PutResult, StoreLookup, StoreEvent (and the callable types a
caller hands it). Plain data; kvtier.store re-exports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.blocks import BlockRows


@dataclass
class PutResult:
    """What a put did: ``stored`` new blocks, ``skipped`` already held or in flight, ``rejected`` keys that
    could not be stored (every block that could make room is pinned or busy)."""

    stored: int = 0
    skipped: int = 0
    rejected: list[bytes] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.rejected


@dataclass
class StoreLookup:
    """TieredStore.lookup_prefix's answer: ``length`` leading keys are held; ``tiers[i]`` names the (highest) tier holding key i."""

    length: int
    tiers: list[str]

    def count(self, tier: str) -> int:
        return self.tiers.count(tier)


@dataclass(frozen=True)
class StoreEvent:
    """Keys that a tier gained ("stored") or lost ("removed": evicted or removed)."""

    kind: str
    tier: str
    keys: list[bytes]


Listener = Callable[[StoreEvent], None]
# put_in_place's writer: (positions in the batch, the top-tier slot addresses to write them to).
Fill = Callable[[list[int], BlockRows], None]


__all__ = ["Fill", "Listener", "PutResult", "StoreEvent", "StoreLookup"]
