"""kvtier.client: the SDK for kvtier-master.

* ``MasterClient`` / ``AsyncMasterClient``: every master op (lookup, cost, route_put, heat, top, nodes,
  pin/unpin/priority, hints) with timeouts and reconnects;
* ``Router``: ``rank(token_ids or keys, workers)`` -> cost-ranked plans; ``prefetch(prompt, worker)`` and
  ``route(prompt, workers)`` ask the worker that will serve a prompt to bring its prefix up into DRAM first;
* ``NodeAgent``: the node side: publishes a TieredStore's events, heartbeats, inventories, hints;
* ``StoreHints``: the master's pins and priorities applied to a node's store as leases;
* ``StorePrefetch``: the master's prefetch orders made jobs of a node store's Prefetcher.

Results: ``MasterLookup`` (``lookup``; its ``hits`` are ``NodeTierHit``s), ``MasterHints`` (``hints``), ``Plan``,
``CostResult``, ``HeatResult``, ``LocateResult``, ``TopResult``. The old names ``LookupResult``, ``PrefixHit`` and
``Hints`` still import from here, with a DeprecationWarning (``Hints`` was also the connectors' name for an
agent's request hints, now ``kvtier.connectors.hints.AgentHints``).

Engine-compatible hashers (token ids -> the engine's own block hashes) are in kvtier.keys.hashers.
"""

import importlib
import warnings
from typing import Any

from kvtier.client.api import (CostResult, HeatResult, LocateResult, MasterHints, MasterLookup, NodeTierHit, Plan,
                               PrefetchResult, TopResult)
from kvtier.client.master import AsyncMasterClient, MasterClient, MasterError, MasterTimeout, MasterUnknownNode
from kvtier.client.router import Routed, Router

__all__ = [
    "AsyncMasterClient", "CostResult", "HeatResult", "LocateResult", "MasterClient", "MasterError", "MasterHints",
    "MasterLookup", "MasterTimeout", "MasterUnknownNode", "NodeAgent", "NodeTierHit", "Plan", "PrefetchResult",
    "Routed", "Router", "StoreHints", "StorePrefetch", "TopResult",
]

# The store's side of the SDK, loaded on first use: the master's clients sit a floor below the store (the pool
# tier asks the master through MasterClient), these three work on a node's store and its Prefetcher
# (tests/test_layering.py).
_STORE_SIDE = {"NodeAgent": "kvtier.client.agent", "StoreHints": "kvtier.client.store_hints",
               "StorePrefetch": "kvtier.client.store_prefetch"}
# The SDK's old result names (deprecated; not in __all__): each is the same class as its new name.
_DEPRECATED = {"LookupResult": MasterLookup, "PrefixHit": NodeTierHit, "Hints": MasterHints}


def __getattr__(name: str) -> Any:
    module = _STORE_SIDE.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    cls = _DEPRECATED.get(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"kvtier.client.{name} is deprecated: use kvtier.client.{cls.__name__}", DeprecationWarning,
                  stacklevel=2)
    return cls
