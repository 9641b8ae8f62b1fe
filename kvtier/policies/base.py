"""The eviction policy protocol: which blocks to drop when a tier is full.

A policy tracks keys only; the tier owns the bytes, the slots and the pins. All methods take batches, so a
put of 2,000 blocks is one call. Policies are not thread-safe: the tier calls them under its own lock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import ClassVar, Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    """insert / access / remove / victims. ``capacity`` (in blocks) is given at construction."""

    name: ClassVar[str]

    def insert(self, keys: Sequence[bytes]) -> None:
        """Start tracking newly stored keys (none of them is tracked yet)."""

    def access(self, keys: Sequence[bytes]) -> None:
        """Record a hit on tracked keys; untracked keys are ignored."""

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking keys (removed by the caller); untracked keys are ignored."""

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        """Choose up to ``n`` tracked keys not in ``protected``, stop tracking them, and return them.

        Fewer than ``n`` are returned only when every other tracked key is protected.
        """

    def __len__(self) -> int:
        """Number of tracked keys."""
