"""open_rank_store: the one store each engine process owns (a vLLM worker, an SGLang scheduler rank), opened the
same way by both connectors: its paths already moved under its model and rank (paths.per_worker), an SSD
directory another process holds named with the likely cause, and the agent hints' lease budget a fraction of the
top tier."""

from __future__ import annotations

from kvtier.config import Config
from kvtier.layout import BlockLayout
from kvtier.store import TieredStore
from kvtier.tiers.ssd import DirectoryInUse


def open_rank_store(config: Config, layout: BlockLayout | int, *, rank: str, engine: str,
                    hint_max_fraction: float) -> TieredStore:
    """The rank's store from ``config`` (per_worker's), with hint leases holding at most ``hint_max_fraction`` of
    its top tier's blocks. DirectoryInUse names the rank and what to change when another server holds the SSD
    directory (two servers of one model on one host with the same ssd_path)."""
    try:
        store = TieredStore.from_config(config, layout)
    except DirectoryInUse as e:
        raise DirectoryInUse(f"kvtier {engine} rank {rank}: {e}; is another {engine} server of this model on this "
                             "host using the same ssd_path? Give each server its own ssd_path") from None
    store.leases.max_keys = max(1, int(store.capacity_blocks * hint_max_fraction))
    return store
