"""kvtier's vLLM connector: ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.connectors.vllm", ...}'`` (see connector.py and docs/vllm.md).

Rooms: connector.py (the KVConnectorBase_V1 subclass, thin), scheduler.py (what to load and save),
worker.py (the rank's store, lookups, finished/failed tracking), transfer.py (copy threads), pagedkv.py
(vLLM's KV tensors as packed blocks), lookup.py (scheduler <-> worker lookups over zmq), metadata.py,
settings.py (kv_connector_extra_config), events.py (KV events), stats.py.

``KVTierConnector`` is imported on first access (vLLM's factory does ``getattr(module, name)``), so the
modules that do not need vLLM (lookup.py, settings.py, pagedkv.py) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from .connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
