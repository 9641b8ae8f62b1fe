"""The SSD tier, one family: DiskTier (tier.py) over its slot bookkeeping and files (slots.py), the lmdb index
(index.py), the segment files and staging memory (io.py), reads (read.py), writes and index commits (write.py) and
the warm restart (restore.py). ``kvtier.tiers.ssd`` names what its users import: DiskTier and DirectoryInUse."""

from kvtier.tiers.ssd.io import DirectoryInUse
from kvtier.tiers.ssd.tier import DiskTier

__all__ = ["DirectoryInUse", "DiskTier"]
