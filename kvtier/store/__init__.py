"""The store, one family: TieredStore (tiered.py) over the tiers a Config describes (build.py: the tier table of
kvtier/settings/tiers.py walked in order, and the offloaders between them), its writes (writes.py), the claims
that let concurrent puts of one block pay once (inflight.py), leases (leases.py) and the vocabulary its callers
and listeners share (types.py). ``kvtier.store`` names what its users import.

Loaded on first use: a daemon (kvtier-pool) imports ``kvtier.store.types`` alone, the events it publishes, and
must not load every tier with it.
"""

import importlib
from typing import Any

_NAMES = {
    "TieredStore": "tiered", "PutPlan": "writes",
    "BroughtUp": "types", "Fill": "types", "Listener": "types", "PutResult": "types", "StoreEvent": "types",
    "StoreLookup": "types",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
