"""PoolKeys: the mode (where the store's DRAM lives) and the pool tier's keys (kvtier/tiers/pool.py): the node
pool, remote pools, kvtier-master; their checks and the PoolTier they describe (docs/pool.md "Node pool and remote
DRAM: kvtier-pool")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.settings.base import (BlockSize, ConfigError, bytes_field, check_offload_name, check_range,
                                  check_transport_name, endpoint_list, key_field, switch_field)

MODES = ("embedded", "standalone", "distributed")


@dataclass
class PoolKeys:
    """The mode's and the pool tier's section of Config (a base of it: these are Config's fields); the pool tier
    exists in modes standalone and distributed. Pure data."""

    mode: str = key_field("embedded", "embedded: private DRAM (+SSD) in this process; standalone: the node pool "
                                      "(kvtier-pool on this host, shared by its engine processes) is the store's "
                                      "DRAM; distributed: private DRAM, remote pools below it (+SSD below them; "
                                      "docs/pool.md 'Node pool and remote DRAM: kvtier-pool')",
                          MODES)
    pool: str = key_field("", "pool endpoint(s), comma-separated: standalone: the node pool's ipc:///path; "
                              "distributed without a master: each pool's tcp://host:port")
    master: str = key_field("", "distributed: kvtier-master's endpoint (or several masters of one shared "
                                "directory, comma-separated: failed over); it places blocks in pools (route_put) "
                                "and says which pool holds what (locate; then 'pool' is not needed)")
    node_id: str = key_field("", "this engine's name with the master (default host-pid)")
    pool_transport: str = key_field("auto", "how blocks move to and from pools: auto (shm for ipc://; for tcp:// "
                                            "rdma when both ends have a device, else stream), stream (raw TCP "
                                            "received in place), tcp (zmq frames), rdma, shm, or one registered "
                                            "by name (kvtier.transport.registry)")
    pool_timeout_ms: int = key_field(500, "a pool call's deadline is this plus its bytes at 100 MB/s, whatever "
                                          "the pool does (silent, trickling); a call past it turns its blocks into "
                                          "misses (the engine recomputes) and the pool is skipped for a back-off "
                                          "(0.5 s doubling to 10 s)")
    pool_connections: int = key_field(4, "parallel connections per pool for big batches")
    pool_copy_threads: int = key_field(0, "threads per shared-memory copy to/from a pool on this host (shm "
                                          "transport): 0 = auto (for a batch of 1 MiB or more the count, 1 or 2, "
                                          "that copied fastest in this process lately; 1 for a smaller one; "
                                          "docs/pool.md 'Shared-memory copy threads')")
    # The default by measurement (kvtier replay, DRAM 5% + pool 20%, docs/prefetch.md "the pool's offload by
    # measurement"): write_through serves more even to one engine, because on_evict cannot see what a pool
    # evicted (RemoteTier.held_locally: a block sent or fetched once is not sent again, though the pool may have
    # dropped it since).
    pool_offload: str = key_field("write_through", "when blocks go from private DRAM to the pool: write_through "
                                                   "(every put: other nodes see them at once; measured best for "
                                                   "one engine too: docs/prefetch.md \"Admission at every level, "
                                                   "and the pool's offload by measurement\"), on_evict, second_hit, "
                                                   "or one registered by name")
    pool_promote: str = switch_field("auto", "copy a block served from a pool into private DRAM too: true, "
                                             "false, or auto (as ssd_promote, which also switched this before "
                                             "pool_promote existed)")
    pool_staging_bytes: int = bytes_field("256MiB", "host memory for blocks queued for the pool "
                                                    "(write-behind); 0 sends on the caller's thread (never under "
                                                    "DRAM's lock)")
    auth_dir: str = key_field("", "CurveZMQ keys for a master and pools started with --auth-dir: this client's "
                                  "client.key_secret and the daemons' server.key (or servers/<endpoint>.key); "
                                  "empty: plain zmq (a keyless daemon of this user is found by its owner "
                                  "token; docs/pool.md 'Authenticated sockets')")
    standalone_dram_capacity: int = bytes_field(0, "standalone: a private DRAM tier above the node pool "
                                                   "(0: none, the node pool is the top tier)")

    def pool_endpoints(self) -> list[str]:
        """The endpoints of ``pool``; ConfigError for one that is not tcp:// or ipc://."""
        return endpoint_list("pool", self.pool)

    def check_pool_keys(self) -> None:
        """ConfigError naming the first pool or mode key a PoolTier would refuse, or a mode its keys contradict
        (the SSD's part of a mode's rules is Config's, which holds both sections)."""
        check_range("pool_timeout_ms", self.pool_timeout_ms, 1, 60_000)
        check_offload_name("pool_offload", self.pool_offload)
        check_range("pool_connections", self.pool_connections, 1, 64)
        check_range("pool_copy_threads", self.pool_copy_threads, 0, 16, " (0: by measured rate)")
        pools = self.pool_endpoints()
        endpoint_list("master", self.master)  # else the workers' zmq connect fails when the pool tier is built
        check_transport_name("pool_transport", self.pool_transport, pools)
        if self.mode == "embedded" and (pools or self.master):
            raise ConfigError("pool/master are set but mode is 'embedded' (set mode to standalone or distributed)")
        if self.mode == "standalone" and len(pools) != 1:
            raise ConfigError("mode 'standalone' needs exactly one 'pool' endpoint: the node pool, e.g. "
                              "ipc:///run/kvtier/pool.sock")
        if self.mode == "distributed" and not (pools or self.master):
            raise ConfigError("mode 'distributed' needs 'master' (kvtier-master) or 'pool' (a list of pools)")

    def pool_block_sizes(self, block_bytes: int) -> list[BlockSize]:
        """The pool-side sizes that must hold a block of ``block_bytes``: its staging (0: none) and, standalone,
        the private DRAM above the node pool (0: none)."""
        sizes: list[BlockSize] = []
        if self.mode == "standalone":
            sizes.append(("standalone_dram_capacity", self.standalone_dram_capacity, block_bytes))
        if self.mode != "embedded":
            sizes.append(("pool_staging_bytes", self.pool_staging_bytes, block_bytes))
        return sizes

    def pool_args(self, block_bytes: int, dtypes: Sequence[str]) -> dict[str, Any]:
        """PoolTier's arguments but its route (PoolTier.from_config picks kvtier-master's or the listed pools')."""
        return dict(block_bytes=block_bytes, transport=self.pool_transport, timeout_s=self.pool_timeout_ms / 1000,
                    connections=self.pool_connections, staging_bytes=self.pool_staging_bytes,
                    dtypes=tuple(dtypes), auth_dir=self.auth_dir, copy_threads=self.pool_copy_threads)
