"""Tiers below the engine's HBM, one module each, behind the Tier protocol in base.py."""

from kvtier.tiers.base import EvictListener, Tier, TierStats
from kvtier.tiers.dram import DramTier

__all__ = ["DramTier", "EvictListener", "Tier", "TierStats"]
