"""kvtier's SGLang HiCache L3 backend: ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierHiCacheStorage",
"interface_v1": 1, ...}'`` (see backend.py and docs/sglang.md).

Rooms: backend.py (the HiCacheStorage subclass, thin: SGLang's contract, failures as misses, metrics),
pagestore.py (host pages in and out of the store, the copies), pages.py (a host pool's page geometry and copy
tables), identity.py (rank, namespace, directories, the MLA sharing rule), settings.py (the extra config),
events.py (L3 KV events in SGLang's format), hints.py (kvtier's SGLang plugin: requests' kv_hints to the backend).

``KVTierHiCacheStorage`` is imported on first access (SGLang's factory does ``getattr(module, class_name)``),
so the modules that do not need SGLang (settings.py, identity.py, pages.py, pagestore.py) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierHiCacheStorage":
        from .backend import KVTierHiCacheStorage

        return KVTierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
