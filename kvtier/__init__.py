"""kvtier: KV-cache tiering for LLM serving.

Core: packed blocks (``BlockLayout``) keyed by 16-byte namespaced keys (``Namespace``), stored in a
``TieredStore`` over host DRAM and lower tiers, configured by one ``Config``.
"""

from kvtier.config import Config, ConfigError
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.layout import BlockLayout, CacheGroup
from kvtier.store import PrefixLookup, PutResult, StoreEvent, TieredStore

__version__ = "0.1.0"

__all__ = [
    "KEY_BYTES", "BlockLayout", "CacheGroup", "Config", "ConfigError", "Namespace", "PrefixLookup",
    "PutResult", "StoreEvent", "TieredStore", "__version__",
]
