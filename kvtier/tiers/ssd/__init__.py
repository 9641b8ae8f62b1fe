"""The SSD tier, one family: DiskTier (tier.py) over its slot bookkeeping and files (slots.py), the lmdb index
(index.py), the segment files and aligned staging memory (io.py), reads (read.py), writes and index commits
(write.py) and the warm restart (restore.py). ``kvtier.tiers.ssd`` names what its users import: DiskTier and
DirectoryInUse."""

from typing import Any

__all__ = ["DirectoryInUse", "DiskTier"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: writebehind.py (which DiskTier composes) takes its staging memory from io.py, and an
    # eager import of tier.py here would make that a circle.
    if name == "DiskTier":
        from kvtier.tiers.ssd.tier import DiskTier

        return DiskTier
    if name == "DirectoryInUse":
        from kvtier.tiers.ssd.io import DirectoryInUse

        return DirectoryInUse
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
