"""PoolStores: every host pool of an SGLang model (KV, and a hybrid model's MAMBA, SWA, indexer, draft pools) in
kvtier, one store per pool, and SGLang's v2 calls (``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``)
answered over them.

Why one store per pool: a TieredStore holds blocks of one size, and each pool's page has its own (a Mamba
state slot, an SWA page of the sliding-window layers, a KV page of the full layers). Each pool's pages are
stored under a namespace of their own: the rank's namespace (identity.py) with the pool's name and its page
geometry fingerprint (pages.py: class, layout, dtype, page size, segment sizes; for Mamba also the temporal and
conv dtypes and shapes) folded into the host fingerprint. So a MAMBA page is never served as a KV or SWA page,
nor a page of another dtype, size or layout (it is another key: a miss). Position is in the key already: SGLang
keys a pool's page by the chained KV page key of the page it belongs to (a Mamba state by the key of the last
page of the prefix it ends), and a chained key names the whole prefix before it.

The KV pool keeps the namespace the v1 calls always used (pages saved by ``batch_set_v1`` are the KV pages
the v2 calls find). Mamba state is TP-sharded even where the KV is rank-replicated (MLA, Kimi's KDA): its
namespace always carries the TP rank (SGLang backs it up on every rank, ``should_backup``).

Memory: the KV store gets ``1 - sidecar_share`` of dram_capacity, ssd_capacity and the SSD staging; the other
pools share ``sidecar_share`` evenly, each its own bounded store (its own DRAM tier and SSD directory
``<rank dir>-<pool>``), so every existing guarantee (checksums, deadlines, memory bounds) holds per pool.
Only mode embedded stores extra pools: the node pool holds blocks of one size (refused at start-up otherwise).

Thread-safe (each PageStore is; the pool table is fixed once opened).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvtier.config import Config, ConfigError
from kvtier.connectors.hints import AgentHints
from kvtier.store import TieredStore

from .hits import PoolQuery, span_hits
from .identity import StorageIdentity
from .pages import HostPages, PageGeometryError, page_keys_ok
from .pagestore import PageStore

log = logging.getLogger(__name__)

KV = str(PoolName.KV)
Move = Callable[["PoolStore", list[str], torch.Tensor], list[bool]]  # one pool's pages in or out: hit per page


class UnsupportedModel(ConfigError):
    """The model has a host pool this backend cannot store (named, with what to do)."""


def _unsupported(name: str, host_pool: Any, why: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"kvtier cannot store SGLang host pool {name!r} ({type(host_pool).__name__}): {why}. Run this model "
        "without --hicache-storage-backend (HiCache keeps L1/L2), or with a backend that stores whole flat pages "
        "(--hicache-storage-backend file)")


def pool_pages(name: str, host_pool: Any, *, interface: str, copy_threads: int) -> HostPages:
    """The page geometry of one registered pool (its ``get_page_buffer_meta``: the DSA indexer's pool keeps its
    pages outside ``kv_buffer``, so that is what is asked), or UnsupportedModel naming it and what to do: a pool
    without buffers of its own, a layout whose pages are not fixed segments (SGLang raises for them)."""
    try:
        return HostPages(host_pool, interface=interface, copy_threads=copy_threads)
    except Exception as e:  # whatever the pool raises describing a page: start-up fails, naming it
        raise _unsupported(name, host_pool, f"its pages have no fixed segment table ({type(e).__name__}: {e})"
                           ) from None


def pool_signature(name: str, host_pool: Any, pages: HostPages) -> str:
    """The host fingerprint of a pool's namespace: its name, its page geometry and, for a Mamba pool, the state
    dtypes and shapes (conv and temporal may differ in dtype while their byte sizes agree)."""
    desc = [name, pages.fingerprint]
    if isinstance(host_pool, MambaPoolHost):
        desc += [str(host_pool.temporal_dtype), str(host_pool.conv_dtype), str(tuple(host_pool.temporal_state_shape)),
                 str([tuple(s) for s in host_pool.conv_state_shapes]), str(host_pool.num_mamba_layers)]
    return hashlib.sha256("\x1f".join(desc).encode()).hexdigest()[:16]


def pool_identity(identity: StorageIdentity, name: str) -> StorageIdentity:
    """The rank identity a pool's keys carry: Mamba state is TP-sharded even where the KV is rank-replicated (MLA
    with KDA state: SGLang backs the state up on every rank, ``should_backup``), so its keys carry the TP rank."""
    return dataclasses.replace(identity, rank_replicated=False) if name == str(PoolName.MAMBA) else identity


def pool_config(config: Config, name: str, share: float) -> Config:
    """``config`` for one pool's store: ``share`` of its capacities and SSD staging, its own SSD directory and
    DRAM file (``<path>-<pool>``, beside the KV store's, which the SSD tier locks as its own)."""
    scaled = {key: max(1, int(getattr(config, key) * share))
              for key in ("dram_capacity", "ssd_capacity", "ssd_staging_bytes")}
    if name != KV:
        scaled |= {key: f"{getattr(config, key)}-{name}" for key in ("ssd_path", "dram_shm_path")
                   if getattr(config, key)}
    return dataclasses.replace(config, **scaled)


@dataclass
class PoolStore:
    """One pool's pages in its own store (owned: closed by ``close``)."""

    name: str
    host_pool: Any
    pages: HostPages
    page_store: PageStore

    @property
    def store(self) -> TieredStore:
        return self.page_store.store

    def present(self, page_keys: Sequence[str]) -> list[bool]:
        """Which of ``page_keys`` this pool holds (one batched lookup)."""
        return self.store.contains(self.page_store.keys(page_keys)) if page_keys else []

    def close(self) -> None:
        self.page_store.close()
        self.store.close()


class PoolStores:
    """The KV pool's PageStore and one PoolStore per extra pool; SGLang's v2 calls over them."""

    def __init__(self, kv: PageStore, kv_pool: Any, extra: Mapping[str, PoolStore]) -> None:
        self.pools: dict[str, PoolStore] = {KV: PoolStore(KV, kv_pool, kv.pages, kv), **extra}
        self._refused: dict[str, int] = {}  # v2 transfers refused since the last take_counts, by pool name
        self._lock = threading.Lock()

    @classmethod
    def open(cls, kv: PageStore, kv_pool: Any, host_pools: Mapping[str, Any], *, config: Config,
             identity: StorageIdentity, interface: str, share: float, staging_bytes: int) -> PoolStores:
        """Open a store per extra pool (``host_pools``: name -> SGLang host pool, KV excluded); UnsupportedModel
        or ConfigError naming the pool if one cannot be stored. Nothing is left open on failure."""
        each = share / max(1, len(host_pools))
        opened: dict[str, PoolStore] = {}
        try:
            for name, host_pool in host_pools.items():
                pages = pool_pages(name, host_pool, interface=interface, copy_threads=config.copy_threads)
                cfg = pool_config(config, name, each)
                try:
                    store = TieredStore.from_config(cfg, pages.block_bytes)
                except (ConfigError, ValueError) as e:  # a size no tier of it can hold: name the pool
                    raise ConfigError(f"host pool {name!r} (pages of {pages.block_bytes} B, {each:.0%} of the "
                                      f"capacities: sidecar_share {share} over {len(host_pools)} pools): {e}") from None
                namespace = pool_identity(identity, name).namespace(pool_signature(name, host_pool, pages))
                opened[name] = PoolStore(name, host_pool, pages,
                                         PageStore(store, namespace, pages, max(1, int(staging_bytes * each))))
                log.info("kvtier HiCache L3 pool %s: %s; namespace %s", name, pages.describe(),
                         namespace.digest.hex()[:12])
        except BaseException:
            for pool in opened.values():
                pool.close()
            raise
        return cls(kv, kv_pool, opened)

    @property
    def extra(self) -> list[PoolStore]:
        return [p for n, p in self.pools.items() if n != KV]

    # ---- SGLang's v2 calls (the backend guards them: a failure is a miss) -----------------------------------

    def exists(self, keys: list[str], transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
        """``batch_exists_v2``: the KV pool's leading run over ``keys``, then each transfer's pool by its hit
        policy (hits.py). A pool kvtier does not store allows nothing (no hit rather than KV without its state)."""
        kv_pages = self.pools[KV].page_store.exists(keys)
        queries = [self._query(t, keys[:kv_pages]) for t in transfers]
        hits = span_hits(kv_pages, queries)
        return PoolTransferResult(hits.final, hits.pool_pages, hits.restorable)

    def _query(self, transfer: PoolTransfer, span: list[str]) -> PoolQuery:
        name, policy = str(transfer.name), PoolHitPolicy(transfer.hit_policy).value
        pool = self.pools.get(name)
        if policy == PoolHitPolicy.BLOCK_GROUPS.value:
            own = list(transfer.keys or ())
            present = pool.present(own) if pool is not None and page_keys_ok(own) else []
            return PoolQuery(name, policy, present, block_pages=transfer.block_pages, group_pages=transfer.group_pages)
        present = pool.present(span) if pool is not None else [False] * len(span)
        return PoolQuery(name, policy, present, window=max(1, len(transfer.keys or ())))

    def transfer(self, transfers: Sequence[PoolTransfer], move: Move,
                 on_error: Callable[[str, BaseException], None]) -> dict[str, list[bool]]:
        """``batch_get_v2`` / ``batch_set_v2``: ``move`` each transfer's pages (its keys, its pool's host indices:
        ``len(keys) * page_size`` slots of that pool); a pool that fails answers all False, the others go on."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or ())
            try:
                pool = self.pools.get(str(t.name))
                if pool is None:
                    raise KeyError(f"host pool {str(t.name)!r} is not stored by kvtier (stored: {list(self.pools)})")
                if not page_keys_ok(keys):
                    raise ValueError("page keys must be non-empty strings")
                if t.host_indices is None:
                    raise ValueError(f"no host indices for {len(keys)} pages")
                out[t.name] = move(pool, keys, t.host_indices.to("cpu", torch.int64)) if keys else []
            except Exception as e:
                with self._lock:
                    self._refused[str(t.name)] = self._refused.get(str(t.name), 0) + 1
                on_error(str(t.name), e)
                out[t.name] = [False] * len(keys)
        return out

    @staticmethod
    def load(pool: PoolStore, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        return pool.page_store.get_pages(keys, host_indices)

    @staticmethod
    def save(hints: AgentHints | None) -> Move:
        return lambda pool, keys, host_indices: pool.page_store.set_pages(keys, host_indices, hints)

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Each pool's page counters since the last call (pagestore.COUNTERS, and ``refused``: its v2 transfers
        that failed as a whole: unknown pool, bad indices or keys, a store error), and reset them. A pool name
        SGLang asked for that kvtier does not store has the ``refused`` count only."""
        with self._lock:
            refused, self._refused = self._refused, {}
        out = {name: {**pool.page_store.take_counts(), "refused": refused.pop(name, 0)}
               for name, pool in self.pools.items()}
        return out | {name: {"refused": n} for name, n in refused.items()}

    def close(self) -> None:
        """Close the extra pools' stores (the KV store is the backend's)."""
        for pool in self.extra:
            pool.close()


__all__ = ["PoolStores", "PoolStore", "UnsupportedModel", "pool_config", "pool_identity", "pool_pages",
           "pool_signature", "PageGeometryError"]
