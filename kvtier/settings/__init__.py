"""The config keys, one section per tier: each declares its keys (default, help, choices, kind) and checks them.

``kvtier.config.Config`` is these sections composed into one flat dataclass (the flat dict users write), and
``Config.validate`` asks each section in turn; the tier table (tiers.py) says which kinds of tier a store stacks,
in which order, and the store's builders (``kvtier.store.build``) ask each section for its tier's arguments. A
built-in tier's keys are a section here; a registered tier's settings live under the ``tiers`` key, checked by
its own ``check`` (tiers.py), so adding one needs no edit here.

A package of its own, not beside the tiers (``kvtier/tiers/dram.py`` imports torch, and importing
``kvtier.tiers`` loads its base module with numpy): importing the config must stay light, as the master daemon,
a router and ``kvtier config`` import it and hold no blocks. Pure data and checks; no I/O, no threads.

    base.py   ConfigError, the field helpers (help, choices, kind metadata), the checks several sections share
    dram.py   DramKeys: the host DRAM tier
    ssd.py    SsdKeys: the local SSD tier
    pool.py   PoolKeys: the mode, and the pool tier (node pool, remote pools, kvtier-master)
    store.py  StoreKeys: the store's own (async threads, close, registered tiers, the model in the namespace)
    tiers.py  the tier table: TierSpec, register_tier (dram, pool, ssd, and yours)
"""

from kvtier.settings.base import ConfigError
from kvtier.settings.dram import DramKeys
from kvtier.settings.pool import PoolKeys
from kvtier.settings.ssd import SsdKeys
from kvtier.settings.store import StoreKeys

__all__ = ["ConfigError", "DramKeys", "PoolKeys", "SsdKeys", "StoreKeys"]
