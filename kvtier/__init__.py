"""kvtier: KV-cache tiering for LLM serving.

Core: packed blocks (``BlockLayout``) keyed by 16-byte namespaced keys (``Namespace``), stored in a
``TieredStore`` over host DRAM and lower tiers, configured by one ``Config``. ``StoreLookup``: what
``TieredStore.lookup_prefix`` returns (its old name ``PrefixLookup`` still imports from here, with a
DeprecationWarning).
"""

import warnings
from typing import Any

from kvtier.config import Config, ConfigError
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.layout import BlockLayout, CacheGroup
from kvtier.store import PutResult, StoreEvent, StoreLookup, TieredStore

__version__ = "0.1.0"

__all__ = [
    "KEY_BYTES", "BlockLayout", "CacheGroup", "Config", "ConfigError", "Namespace", "PutResult",
    "StoreEvent", "StoreLookup", "TieredStore", "__version__",
]


def __getattr__(name: str) -> Any:
    # The old name of StoreLookup (deprecated; not in __all__).
    if name != "PrefixLookup":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("kvtier.PrefixLookup is deprecated: use kvtier.StoreLookup", DeprecationWarning, stacklevel=2)
    return StoreLookup
