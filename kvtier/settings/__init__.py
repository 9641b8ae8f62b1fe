"""The config keys, one section per tier: each declares its keys (default, help, choices, kind) and checks them.

``kvtier.config.Config`` is these sections composed into one flat dataclass (the flat dict users write), and
``Config.validate`` asks each section in turn; ``kvtier.store.build`` asks each section for its tier's
arguments. A new tier's keys are a new section here, a base of Config and one line of its validate and of
store_build.

A package of its own, not beside the tiers (``kvtier/tiers/dram.py`` imports torch, and importing
``kvtier.tiers`` loads its base module with numpy): importing the config must stay light, as the master daemon,
a router and ``kvtier config`` import it and hold no blocks. Pure data and checks; no I/O, no threads.

    base.py   ConfigError, the field helpers (help, choices, kind metadata), the checks several sections share
    dram.py   DramKeys: the host DRAM tier
    ssd.py    SsdKeys: the local SSD tier
    pool.py   PoolKeys: the mode, and the pool tier (node pool, remote pools, kvtier-master)
    store.py  StoreKeys: the store's own (async threads, close, the model in the namespace)
"""

from kvtier.settings.base import ConfigError
from kvtier.settings.dram import DramKeys
from kvtier.settings.pool import PoolKeys
from kvtier.settings.ssd import SsdKeys
from kvtier.settings.store import StoreKeys

__all__ = ["ConfigError", "DramKeys", "PoolKeys", "SsdKeys", "StoreKeys"]
