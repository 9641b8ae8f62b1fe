"""kvtier: KV-cache tiering for LLM serving.

Core: packed blocks (``BlockLayout``) keyed by 16-byte namespaced keys (``Namespace``), stored in a
``TieredStore`` over host DRAM and lower tiers, configured by one ``Config``. ``StoreLookup``: what
``TieredStore.lookup_prefix`` returns (its old name ``PrefixLookup`` still imports from here, with a
DeprecationWarning).

The names below load on first use: every module of kvtier (a daemon's, a tier's) imports this package first, and
an eager import of the store here would make each of them load every tier and put the store under all of them
(tests/test_layering.py reads package imports as arrows).
"""

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Config": "kvtier.config", "ConfigError": "kvtier.config", "KEY_BYTES": "kvtier.keys", "Namespace": "kvtier.keys",
    "BlockLayout": "kvtier.layout", "CacheGroup": "kvtier.layout", "PutResult": "kvtier.store.types",
    "StoreEvent": "kvtier.store.types", "StoreLookup": "kvtier.store.types", "TieredStore": "kvtier.store.tiered",
}

__all__ = [*sorted(_PUBLIC), "__version__"]


def __getattr__(name: str) -> Any:
    if name == "PrefixLookup":  # the old name of StoreLookup (deprecated; not in __all__)
        warnings.warn("kvtier.PrefixLookup is deprecated: use kvtier.StoreLookup", DeprecationWarning, stacklevel=2)
        name = "StoreLookup"
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
