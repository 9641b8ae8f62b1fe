"""What TieredStore's calls return and announce: PutResult, StoreLookup, StoreEvent (and the callable types a
caller hands it). Plain data; kvtier.store re-exports them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    """TieredStore.lookup_prefix's answer: ``length`` leading keys are held; ``runs`` says by which tier (the
    highest holding each key), as runs of (tier name, count) in key order: a 2,000-key prefix the DRAM holds is
    one run, not 2,000 names."""

    length: int
    runs: list[tuple[str, int]]

    def count(self, tier: str, upto: int | None = None) -> int:
        """Keys among the first ``upto`` (default: the whole prefix) held in ``tier``."""
        return count_in_runs(self.runs, tier, self.length if upto is None else min(upto, self.length))

    @property
    def tiers(self) -> list[str]:
        """The compatibility view of ``runs`` (the field this answer had before them, for callers written
        against it): ``tiers[i]`` names the (highest) tier holding key i, one name per held key. Built on each
        call, O(length): new code reads ``runs`` or ``count``."""
        return [name for name, n in self.runs for _ in range(n)][: self.length]


def count_in_runs(runs: Sequence[tuple[str, int]], tier: str, upto: int) -> int:
    """How many of the first ``upto`` keys described by ``runs`` (tier name, count) are held in ``tier``
    (StoreLookup's and the vLLM connector's rank replies' runs)."""
    total = 0
    for name, n in runs:
        take = min(n, upto)
        if name == tier:
            total += take
        upto -= take
        if upto <= 0:
            break
    return total


@dataclass
class BroughtUp:
    """What one ``TieredStore.bring_up`` did: ``done`` keys of the chain (from its start) were dealt with
    (held on top already, or copied up now); ``moved`` counts the blocks copied up per lower tier they came
    from, ``keys`` names them; ``why`` it stopped: "done" (the chain's end), "missing" (a key no tier holds:
    the prefix ends there), "budget" (a lower tier's budget was spent), "room" (the top tier's policy would
    have to evict blocks needed sooner)."""

    done: int
    moved: dict[str, int]
    keys: list[bytes]
    why: str


@dataclass(frozen=True)
class StoreEvent:
    """Keys that a tier gained ("stored") or lost ("removed": evicted or removed)."""

    kind: str
    tier: str
    keys: list[bytes]


Listener = Callable[[StoreEvent], None]
# put_in_place's writer: (positions in the batch, the top-tier slot addresses to write them to).
Fill = Callable[[list[int], BlockRows], None]


__all__ = ["BroughtUp", "Fill", "Listener", "PutResult", "StoreEvent", "StoreLookup", "count_in_runs"]
