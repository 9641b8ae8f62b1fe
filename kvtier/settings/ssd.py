"""SsdKeys: the local SSD tier's keys (kvtier/tiers/ssd/tier.py), their checks and the DiskTier they describe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.settings.base import (BlockSize, bytes_field, check_offload_name, check_policy_name, check_positive,
                                  check_range, key_field, switch_field)

if TYPE_CHECKING:  # kvtier.policies loads every policy module: only when a check needs it
    from kvtier.policies import Clock

DIRECT_IO_ALIGN = 4096  # O_DIRECT slots are rounded up to this (kvtier/tiers/ssd/io.py)


@dataclass
class SsdKeys:
    """The local SSD tier's section of Config (a base of it: these are Config's fields); the tier is off while
    ``ssd_path`` is empty. Pure data."""

    ssd_path: str = key_field("", "directory for the SSD tier's segment files and index (on a local disk; "
                                  "reopened after a restart, its blocks are served again); empty: no SSD tier")
    ssd_capacity: int = bytes_field("64GiB", "most bytes of block data the SSD tier keeps on disk")
    ssd_offload: str = key_field("on_evict", "when blocks go from DRAM to SSD: write_through (every put), on_evict "
                                             "(when DRAM evicts them), second_hit (on eviction, if seen twice), or "
                                             "a policy registered by name (kvtier.offload.register_offload)")
    ssd_promote: bool = key_field(True, "copy a block served from SSD into DRAM too (and from a pool, while "
                                        "pool_promote is auto); off served more on the standard replay slice but "
                                        "cost hit rate with prefetch on the sample's traces (docs/prefetch.md "
                                        "'Between turns: what the defaults are measured on')")
    ssd_eviction: str = key_field("default", "SSD eviction policy: default (pnu, told what the engine knows, as "
                                             "DRAM's), lru, fifo, s3fifo, arc, chain-lru, or an import path")
    ssd_direct_io: str = switch_field("auto", "O_DIRECT for SSD I/O: auto (fall back to buffered I/O, with one "
                                              "warning, where the filesystem lacks it), true, false")
    ssd_fsync: bool = key_field(True, "fsync data and index at the end of each SSD write batch (crash-durable); "
                                      "false keeps checksums but may lose the last writes to a machine crash")
    ssd_segment_bytes: int = bytes_field("256MiB", "size of each SSD segment file")
    ssd_staging_bytes: int = bytes_field("256MiB", "host memory for blocks queued for the SSD (write-behind); "
                                                   "0 writes offloads synchronously on the caller's thread (never "
                                                   "under DRAM's lock)")
    ssd_io_threads: int = key_field(4, "threads doing the SSD tier's preadv/pwritev")

    def check_ssd_keys(self) -> None:
        """ConfigError naming the first SSD key a DiskTier would refuse (an unknown policy among them)."""
        if self.ssd_path:
            check_positive("ssd_capacity", self.ssd_capacity)
        check_positive("ssd_segment_bytes", self.ssd_segment_bytes)
        check_range("ssd_io_threads", self.ssd_io_threads, 1, 64)
        check_policy_name("ssd_eviction", self.ssd_eviction)
        check_offload_name("ssd_offload", self.ssd_offload)

    def ssd_block_sizes(self, block_bytes: int) -> list[BlockSize]:
        """The SSD sizes that must hold a block of ``block_bytes``: none while there is no SSD tier."""
        if not self.ssd_path:
            return []
        # auto may fall back to buffered I/O (unaligned slots), so only true rounds here.
        slot = -(-block_bytes // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN if self.ssd_direct_io == "true" else block_bytes
        return [("ssd_capacity", self.ssd_capacity, slot)]

    def ssd_args(self, block_bytes: int, fingerprint: str, dtypes: Sequence[str],
                 clock: Clock | None) -> dict[str, Any]:
        """DiskTier's arguments (the store's offload policy and promote switch for it: ssd_offload, ssd_promote)."""
        return dict(path=self.ssd_path, capacity_bytes=self.ssd_capacity, block_bytes=block_bytes,
                    segment_bytes=self.ssd_segment_bytes, policy=self.ssd_eviction, direct_io=self.ssd_direct_io,
                    fsync=self.ssd_fsync, io_threads=self.ssd_io_threads, staging_bytes=self.ssd_staging_bytes,
                    fingerprint=fingerprint, dtypes=tuple(dtypes), clock=clock)
