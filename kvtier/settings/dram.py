"""DramKeys: the host DRAM tier's keys (kvtier/tiers/dram.py), their checks and the DramTier they describe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.settings.base import (BlockSize, bytes_field, check_policy_name, check_positive, check_range,
                                  key_field, switch_field)

if TYPE_CHECKING:  # kvtier.policies loads every policy module: only when a check needs it
    from kvtier.policies import Clock


@dataclass
class DramKeys:
    """The host DRAM tier's section of Config (a base of it: these are Config's fields). Pure data."""

    dram_capacity: int = bytes_field("4GiB", "bytes of host DRAM for packed blocks, allocated once")
    dram_shm_path: str = key_field("", "back the DRAM buffer with this file (e.g. /dev/shm/kvtier) so "
                                       "other processes can map it; empty: private memory")
    dram_pin_memory: str = switch_field("auto", "page-lock the DRAM buffer for fast GPU copies: auto (when CUDA "
                                                "is present), true, false")
    dram_prefault: bool = key_field(False, "touch every page of the DRAM buffer at start-up, so the first "
                                           "puts pay no page faults (costs ~0.1 s per GiB at start)")
    eviction: str = key_field("default", "DRAM eviction policy: default (the session-aware predictor, pnu), lru, "
                                         "fifo, s3fifo, arc, chain-lru, or an import path 'package.module:Class' "
                                         "(docs/eviction.md 'Eviction policies')")
    copy_threads: int = key_field(0, "threads per batched DRAM put/get copy (and SGLang's host pages): 0 = by "
                                      "measured rate (a batch of 1 MiB or more gets the count, 1 or 2, that "
                                      "copied fastest in this process lately, as pool_copy_threads 0; the second "
                                      "thread takes a core only for the copy's milliseconds); 1 where the "
                                      "engine's own threads need every core; N fixes it. Threads copy in place: "
                                      "more never raise memory use")

    dram_admission: str = key_field(
        "auto", "where DRAM's policy may decline a put's new blocks when it is full: last (only where no tier is "
                "below DRAM; above an SSD or a pool a put evicts to make room, the policy choosing the order), "
                "every (above lower tiers too: a declined block goes down as an eviction would, "
                "writes.TopWrites), auto (last, and every above an SSD that is DRAM's only lower tier: "
                "measured better there and worse above a pool in the replay, docs/prefetch.md 'Between turns: what "
                "the defaults are measured on')",
        ("auto", "last", "every"))

    def check_dram_keys(self) -> None:
        """ConfigError naming the first DRAM key a DramTier would refuse (an unknown policy among them)."""
        check_positive("dram_capacity", self.dram_capacity)
        check_range("copy_threads", self.copy_threads, 0, 16, " (0: by measured rate)")
        check_policy_name("eviction", self.eviction)

    def dram_block_sizes(self, block_bytes: int) -> list[BlockSize]:
        """The DRAM sizes that must hold a block of ``block_bytes`` (while dram_capacity sizes the DRAM tier)."""
        return [("dram_capacity", self.dram_capacity, block_bytes)]

    def dram_args(self, capacity: int, block_bytes: int, dtypes: Sequence[str], clock: Clock | None,
                  admission: bool) -> dict[str, Any]:
        """DramTier's arguments for a tier of ``capacity`` bytes (the mode says which key sizes it)."""
        return dict(capacity_bytes=capacity, block_bytes=block_bytes, policy=self.eviction,
                    shm_path=self.dram_shm_path or None, pin_memory=self.dram_pin_memory,
                    prefault=self.dram_prefault, copy_threads=self.copy_threads, dtypes=tuple(dtypes),
                    clock=clock, admission=admission)
