"""StoreKeys: the store's own keys: the async threads, the close deadline, registered tiers, the model in the
namespace."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.settings.base import check_range, key_field, mapping_field
from kvtier.settings.tiers import check_tier_sections


@dataclass
class StoreKeys:
    """TieredStore's own section of Config (a base of it: these are Config's fields). Pure data."""

    io_threads: int = key_field(4, "threads serving the *_async calls")
    close_timeout_s: float = key_field(30.0, "on close (an engine's clean shutdown), write DRAM's blocks that the "
                                             "lower tiers would get on eviction (on_evict: every block the SSD "
                                             "lacks) for at most this long; the rest is lost with the process "
                                             "(logged). The vLLM connector bounds it by vLLM's worker shutdown "
                                             "grace, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + 4 s")
    # Registered tiers (kvtier/settings/tiers.py) stacked beside the built-in ones, each with its own settings.
    tiers: dict = mapping_field("tiers registered with kvtier.settings.tiers.register_tier to stack, by name, each "
                                "with its own settings: {\"<name>\": {...}} (docs/architecture.md 'Where a newcomer "
                                "adds...')")
    # Namespace (used by connectors and the CLI when they make keys).
    model: str = key_field("", "model id folded into every key's namespace (the vLLM connector "
                                 "defaults to the served model)")

    def check_store_keys(self) -> None:
        """ConfigError naming the first of the store's own keys out of its range."""
        check_range("io_threads", self.io_threads, 1, 256)
        check_range("close_timeout_s", self.close_timeout_s, 0, 3600)
        check_tier_sections("tiers", self.tiers)
