"""Tiers below the engine's HBM, one module each, behind the Tier protocol in base.py."""

from typing import Any

from kvtier.tiers.base import (AddressableSlots, EvictListener, ListsKeys, RemoteTier, Reservation, Tier,
                               TierStats, WriteBehindStaging)

__all__ = ["AddressableSlots", "DramTier", "EvictListener", "ListsKeys", "RemoteTier", "Reservation", "Tier",
           "TierStats", "WriteBehindStaging"]


def __getattr__(name: str) -> Any:
    # DramTier imports torch (seconds, and GBs on a GPU box): loaded on first use, so processes that never
    # hold blocks (the master daemon, a router using kvtier.client) do not pay for it.
    if name == "DramTier":
        from kvtier.tiers.dram import DramTier

        return DramTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
