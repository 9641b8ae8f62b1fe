"""BackendSettings: what an SGLang user writes in ``--hicache-storage-backend-extra-config``, split in three.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
      "module_path": "kvtier.connectors.sglang", "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
      "dram_capacity": "64GiB", "ssd_path": "/nvme/kvtier"}'

* SGLang's own keys (``SGLANG_KEYS``: the dynamic loader's, ``interface_v1``, the prefetch knobs SGLang reads
  and usually strips) pass untouched;
* the backend's own keys (``BackendSettings``: staging memory, the hint budget, where L3 KV events go, prefetch
  between turns) are read here;
* every other key is a store key and goes, as is, to ``kvtier.Config`` (which names an unknown key), so the
  extra config is the same flat dict a vLLM user writes in ``kv_connector_extra_config`` (``mode``, ``pool``,
  ``master``, ``dram_capacity``, ``ssd_path``, ...).

Pure data; no SGLang import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvtier.config import Config, ConfigError, coerce_fields

# Keys SGLang itself puts in or reads from the extra config (hicache_storage.py, backend_factory.py,
# hybrid_cache_controller.parse_storage_backend_extra_config, cache_controller, unified_radix_cache).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size", "file_storage_path")


@dataclass(frozen=True)
class BackendSettings:
    """The backend's keys in the extra config (defaults shown)."""

    # Host memory per direction (allocated on first use) for pages of layouts with several segments (MHA:
    # K and V, or every layer) that cannot be copied straight between the host pool and a DRAM slot: loads of
    # pages found on the SSD or in a pool, saves when the node pool is the top tier. A batch larger than it
    # goes through it in chunks.
    staging_bytes: int = field(default=256 << 20, metadata={"kind": "bytes"})  # or a size: "256MiB"
    # A hybrid model's host pools besides KV (Mamba, SWA, indexer, draft: pools.py) share this fraction of
    # dram_capacity, ssd_capacity and the staging memory, evenly, each in a store of its own; KV keeps the rest.
    # Unused for a model with a KV pool only.
    sidecar_share: float = 0.25
    # Agent hints (a storage call's extra_info["kvtier"]) may pin at most this fraction of the DRAM blocks.
    hint_max_fraction: float = 0.5
    # ZMQ PUB endpoint for kvtier's L3 KV events (SGLang's own event format and publisher; e.g. tcp://*:5560,
    # offset by the attention-DP rank as SGLang offsets its own); empty: no events.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""  # ROUTER endpoint for replays of missed batches; empty: none
    kv_events_topic: str = ""
    # Between turns, bring idle agents' prefixes up into DRAM from the tier below (SSD, pool) before they are
    # predicted back (kvtier/connectors/prefetching.py, as the vLLM connector's key of the same name); only where
    # a tier sits below DRAM. The store then hears of every request (hints.py), not only those with kv_hints.
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.staging_bytes <= 0:
            raise ConfigError(f"staging_bytes must be > 0, got {self.staging_bytes}")
        if not 0 < self.sidecar_share < 1:
            raise ConfigError(f"sidecar_share must be in (0, 1), got {self.sidecar_share}")
        if not 0 <= self.hint_max_fraction <= 1:
            raise ConfigError(f"hint_max_fraction must be in [0, 1], got {self.hint_max_fraction}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and "://" not in value:
                raise ConfigError(f"{name} must be a zmq endpoint such as tcp://*:5560, got {value!r}")


BACKEND_KEYS = tuple(f.name for f in fields(BackendSettings))


def split_extra_config(extra: Mapping[str, Any] | None) -> tuple[BackendSettings, bool, Config]:
    """(backend settings, interface_v1, the store's Config) from SGLang's extra config: its store keys over
    KVTIER_CONFIG and the KVTIER_* variables, merged and validated once (Config.load), so a typo fails at start-up
    with the key named. ConfigError names a bad key."""
    extra = dict(extra or {})
    sglang = {k: extra.pop(k) for k in SGLANG_KEYS if k in extra}
    own = {k: extra.pop(k) for k in BACKEND_KEYS if k in extra}
    try:
        settings = BackendSettings(**coerce_fields(BackendSettings, own))
        config = Config.load(extra)
    except ConfigError as e:
        raise ConfigError(f"--hicache-storage-backend-extra-config: {e} (kvtier backend keys: "
                          f"{', '.join(BACKEND_KEYS)}; SGLang's own: {', '.join(SGLANG_KEYS)})") from None
    return settings, bool(sglang.get("interface_v1", 0)), config

