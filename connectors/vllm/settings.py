"""ConnectorSettings: what a vLLM user writes in ``kv_connector_extra_config``, split in two.

The connector's own keys (how it loads, looks up and saves) are read here; every other key is a store key
and goes, as is, to ``kvtier.Config`` (which names any unknown key), so the extra config is the same flat
dict a Python user gives ``TieredStore.from_config``. Store modes (embedded DRAM + SSD today; the node pool
and the distributed pool) are store keys: the connector never branches on them.

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"dram_capacity": "64GiB", "ssd_path": "/nvme/kvtier", "load_mode": "async"}}'

Pure data; no vLLM import. Built once per connector instance (scheduler and each worker read the same dict).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvtier.config import Config, ConfigError, coerce_fields

LOAD_MODES = ("async", "layerwise")


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's keys in ``kv_connector_extra_config`` (defaults shown)."""

    # async: a request whose prefix is found waits (WAITING_FOR_REMOTE_KVS) while its blocks load between
    # steps, so other requests' forwards never wait; layerwise: the load runs during the request's first
    # forward and each attention layer waits only for its own layer's blocks.
    load_mode: str = "async"
    # Store blocks of generated tokens too (an agent's next turn carries this turn's output in its prompt).
    save_decode: bool = True
    # A lookup not answered by every worker within this time is a miss (the request is scheduled as is).
    lookup_timeout_s: float = 5.0
    # Blocks a lookup found stay pinned until their load, at most this long.
    lease_ttl_s: float = 60.0
    # Per worker and direction: host staging memory between the engine's KV and the store (whole blocks).
    staging_bytes: int = field(default=256 << 20, metadata={"kind": "bytes"})  # or a size: "256MiB"
    # A layer-wise load not finished this long after the forward needs it is a failed load (recomputed); a
    # wait that cannot end early (a save still reading blocks vLLM frees) logs an error each period.
    load_timeout_s: float = 30.0
    # Session hints (kv_transfer_params) may pin at most this fraction of the store's DRAM blocks.
    hint_max_fraction: float = 0.5
    # Directory of the workers' lookup sockets (ipc); empty: $VLLM_RPC_BASE_PATH or the temp directory.
    ipc_dir: str = ""
    # The checkpoint's fingerprint in the key namespace (weights.py): auto (read from the model's files), off,
    # or the fingerprint itself (an id of the checkpoint, e.g. a git commit).
    weights_fingerprint: str = "auto"
    # Between turns, bring idle agents' prefixes up into DRAM from the tier below (SSD, pool) before they are
    # predicted back (connectors/prefetching.py); only where a tier sits below DRAM.
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode: {self.load_mode!r} is not one of {', '.join(LOAD_MODES)}")
        for name in ("lookup_timeout_s", "lease_ttl_s", "load_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.staging_bytes <= 0:
            raise ConfigError(f"staging_bytes must be > 0, got {self.staging_bytes}")
        if not 0 <= self.hint_max_fraction <= 1:
            raise ConfigError(f"hint_max_fraction must be in [0, 1], got {self.hint_max_fraction}")
        if not self.weights_fingerprint:
            raise ConfigError("weights_fingerprint must be auto, off or a non-empty id of the checkpoint")

    @property
    def load_async(self) -> bool:
        return self.load_mode == "async"

    def socket_dir(self) -> str:
        return self.ipc_dir or os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()


CONNECTOR_KEYS = tuple(f.name for f in fields(ConnectorSettings))


def split_extra_config(extra: Mapping[str, Any] | None) -> tuple[ConnectorSettings, Config]:
    """(connector settings, the store's Config) from ``kv_connector_extra_config``: its store keys over KVTIER_CONFIG
    and the KVTIER_* variables, merged and validated once (Config.load), in both roles, so a typo fails at start-up
    with the key named; the process hands this Config down. ConfigError names a bad key."""
    extra = dict(extra or {})
    own = {k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}
    try:
        settings = ConnectorSettings(**coerce_fields(ConnectorSettings, own))
        config = Config.load(extra)
    except ConfigError as e:
        raise ConfigError(f"kv_connector_extra_config: {e} (connector keys: {', '.join(CONNECTOR_KEYS)})") from None
    return settings, config

