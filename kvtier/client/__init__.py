"""kvtier.client: the SDK for kvtier-master.

* ``MasterClient`` / ``AsyncMasterClient``: every master op (lookup, cost, route_put, heat, top, nodes,
  pin/unpin/priority, hints) with timeouts and reconnects;
* ``Router``: ``rank(token_ids or keys, workers)`` -> cost-ranked plans;
* ``NodeAgent``: the node side: publishes a TieredStore's events, heartbeats, inventories, hints;
* ``StoreHints``: the master's pins and priorities applied to a node's store as leases.

Engine-compatible hashers (token ids -> the engine's own block hashes) are in kvtier.hashers.
"""

from kvtier.client.agent import NodeAgent
from kvtier.client.api import CostResult, Hints, HeatResult, LocateResult, LookupResult, Plan, PrefixHit, TopResult
from kvtier.client.master import AsyncMasterClient, MasterClient, MasterError, MasterTimeout, MasterUnknownNode
from kvtier.client.router import Router
from kvtier.client.store_hints import StoreHints

__all__ = [
    "AsyncMasterClient", "CostResult", "HeatResult", "Hints", "LocateResult", "LookupResult", "MasterClient",
    "MasterError", "MasterTimeout", "MasterUnknownNode", "NodeAgent", "Plan", "PrefixHit", "Router", "StoreHints",
    "TopResult",
]
