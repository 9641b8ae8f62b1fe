"""StorageIdentity: which SGLang rank a backend serves, what its page keys are namespaced by, where its files go.

SGLang builds one storage backend per scheduler process (one per TP/PP/attention-CP rank) from a
``HiCacheStorageConfig``. Its page keys carry no rank, model or layout; the backend adds them
(``kvtier.keys.hashers.sglang_namespace``):

* MHA pages hold one TP rank's heads: the namespace has the TP rank and size (so two TP widths never share a
  key, unlike Mooncake's MHA keys), the PP and attention-CP ranks, the model and the host layout fingerprint;
* MLA pages are the same on every TP rank: no TP rank. SGLang makes only the writer (TP rank 0) back pages up,
  every rank looks them up and loads them, and takes the MIN hit over ranks; so the ranks must share a tier.
  ``check_sharing`` refuses an MLA TP > 1 server whose every tier is private per rank (mode embedded: the
  other ranks would never hit) and warns where the shared pool gets pages only on eviction.

The rank's own directories (``ssd_path``, ``dram_shm_path``) are ``<path>/<model dir>/<rank dir>``
(kvtier.connectors.paths), ``<rank dir>`` = ``tp{r}of{n}`` then ``-pp{r}of{n}``, ``-cp{r}of{n}`` when > 1,
``-dp{r}`` for attention-DP ranks > 0. Pure data; no SGLang import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtier.config import Config, ConfigError
from kvtier.keys.hashers import sglang_namespace
from kvtier.keys import Namespace
from kvtier.offload import offload_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageIdentity:
    """One SGLang rank, as its ``HiCacheStorageConfig`` says (``from_storage_config``)."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    rank_replicated: bool = False  # SGLang's is_mla_model: MLA or DeepSeek V4, the same bytes on every TP rank
    writer: bool = True  # SGLang backs pages up from this rank (is_storage_writer)
    split_heads: bool = False  # tp_lcm_size asked for head-split keys (mixed TP widths); not done here

    @classmethod
    def from_storage_config(cls, storage_config: Any, model: str = "") -> StorageIdentity:
        """From SGLang's HiCacheStorageConfig; ``model`` (the ``model`` config key) overrides its model_name.
        ConfigError for what this backend cannot serve (decode context parallelism)."""
        if int(storage_config.dcp_size) > 1:
            raise ConfigError("kvtier's SGLang backend does not support decode context parallelism "
                              f"(dcp_size {storage_config.dcp_size}); SGLang refuses dynamic backends with DCP too")
        name = model or storage_config.model_name or ""
        if not name:
            raise ConfigError("SGLang passed no model name to the storage backend; set the 'model' key in "
                              "--hicache-storage-backend-extra-config (it namespaces every page key)")
        return cls(model=str(name), tp_rank=int(storage_config.tp_rank), tp_size=int(storage_config.tp_size),
                   pp_rank=int(storage_config.pp_rank), pp_size=int(storage_config.pp_size),
                   cp_rank=int(storage_config.attn_cp_rank), cp_size=int(storage_config.attn_cp_size),
                   dp_rank=int(storage_config.dp_rank), rank_replicated=bool(storage_config.is_mla_model),
                   writer=bool(storage_config.is_storage_writer),
                   split_heads=bool(storage_config.should_split_heads))

    def namespace(self, host_fingerprint: str) -> Namespace:
        return sglang_namespace(self.model, host_fingerprint, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                pp_rank=self.pp_rank, pp_size=self.pp_size, cp_rank=self.cp_rank,
                                cp_size=self.cp_size, rank_replicated=self.rank_replicated)

    @property
    def rank_dir(self) -> str:
        name = f"tp{self.tp_rank}of{self.tp_size}"
        if self.pp_size > 1:
            name += f"-pp{self.pp_rank}of{self.pp_size}"
        if self.cp_size > 1:
            name += f"-cp{self.cp_rank}of{self.cp_size}"
        if self.dp_rank:
            name += f"-dp{self.dp_rank}"
        return name

    @property
    def events_publisher(self) -> bool:
        """Whether this rank publishes L3 KV events: the rank SGLang publishes its own events from (PP, attention
        TP and CP rank 0), one publisher per attention-DP rank."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0

    def describe(self) -> str:
        kind = "MLA (rank-replicated)" if self.rank_replicated else "MHA"
        return (f"{self.model} {kind} {self.rank_dir}{'' if self.writer else ' (reader: TP rank 0 writes)'}")


def check_sharing(identity: StorageIdentity, config: Config) -> None:
    """Refuse an MLA TP > 1 store whose tiers are all private to this rank; warn where the ranks share a pool
    that gets pages only on eviction, and where head-split keys were asked for."""
    if identity.split_heads:
        log.warning("kvtier: tp_lcm_size asks for head-split page keys (servers of several TP widths sharing "
                    "pages); kvtier keys pages per TP size, so servers with another TP width do not share them")
    if not identity.rank_replicated or identity.tp_size == 1:
        return
    if config.mode == "embedded":
        raise ConfigError(
            f"MLA model with TP {identity.tp_size} in mode 'embedded': SGLang backs MLA pages up from TP rank 0 "
            "only and takes the shortest hit over the ranks, so private per-rank stores give every prefix a "
            "hit of zero. Let the ranks share a tier: mode 'standalone' (a kvtier-pool on this host) or "
            "'distributed' (pools, kvtier-master)")
    private_top = config.mode == "distributed" or config.standalone_dram_capacity > 0
    offload = offload_policy(config.pool_offload)
    if private_top and not offload.on_put:
        log.warning("kvtier: MLA model with TP %d: TP rank 0 writes pages to its private DRAM and to the shared pool "
                    "only %s; the other ranks miss them until then (set pool_offload write_through)",
                    identity.tp_size, offload.when)
