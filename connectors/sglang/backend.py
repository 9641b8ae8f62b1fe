"""KVTierHiCacheStorage: kvtier as SGLang HiCache's L3 storage backend (SGLang 0.5.23, ``HiCacheStorage``).

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache --hicache-storage-backend dynamic \
      --hicache-storage-backend-extra-config '{"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang",
      "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "dram_capacity": "64GiB"}'

SGLang keeps L1 (GPU) and L2 (its host pool) itself and asks this backend for the rest: kvtier's DRAM, the
node pool, other nodes' pools and the SSD, behind one TieredStore per rank (settings.py: the extra config is
the store's config, the same keys as the vLLM connector's ``kv_connector_extra_config``; identity.py: the
rank, its namespace and directories; pagestore.py: the copies; pools.py and hits.py: a hybrid model's other
host pools (Mamba, SWA, indexer, draft) and the v2 calls; events.py: L3 KV events for routers; hints.py: the
requests' standard kv_hints, brought by kvtier's SGLang plugin and applied to this backend's store;
kvtier/connectors/prefetching.py: where a tier sits below DRAM, the store's Prefetcher brings idle agents'
prefixes up between turns, learning them from the requests hints.py reports).

Lifecycle (SGLang's attach order): ``__init__(storage_config, kwargs)`` validates the config ->
``register_mem_pool_host(pool)`` reads the host pool's page geometry -> ``register_mem_host_pool_v2`` for
each pool -> ``on_host_pools_registered()`` opens the stores (the KV pool's, and one per other pool of a hybrid
model: pools.py; a pool kvtier cannot store is refused there, named) -> the calls below, from SGLang's
prefetch, IO, backup and scheduler threads at once -> ``close()``.

Contract: thread-safe; a failure is a miss or False, never an exception into SGLang (each is logged, at
most once a second per kind); host memory is read and written only during a call.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier.connectors.hints import AgentHints, parse_hints
from kvtier.connectors.paths import PER_WORKER_KEYS, model_dir, per_worker
from kvtier.connectors.prefetching import WorkerPrefetch
from kvtier.connectors.rank_store import open_rank_store
from kvtier.ratelog import RateLimitedLog
from kvtier.store import TieredStore

from . import hints as kv_hints
from .identity import StorageIdentity, check_sharing
from .pages import HostPages, page_keys_ok
from .pagestore import PageStore
from .pools import KV, PoolStores, UnsupportedModel, pool_config
from .settings import BackendSettings, split_extra_config

log = logging.getLogger(__name__)
T = TypeVar("T")

GB = 1e9
METRICS_KEPT = 4096  # samples of each StorageMetrics list kept between two get_stats calls


class KVTierHiCacheStorage(HiCacheStorage):
    """One instance per SGLang rank, in that rank's scheduler process (SGLang's factory builds it). Thread-safe
    for SGLang's concurrent calls; reads and writes the registered host pool only during a call; owns its store
    (closed by ``close``). Lifecycle and failure contract: the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        settings, interface_v1, config = split_extra_config(storage_config.extra_config)
        self.identity = StorageIdentity.from_storage_config(storage_config, config.model)
        check_sharing(self.identity, config)
        self.settings: BackendSettings = settings
        self.interface = "v1" if interface_v1 else "flat"
        # Each rank is its own process with its own store: paths a store owns get the rank's subdirectory.
        self.config = per_worker(config, model_dir(self.identity.model), self.identity.rank_dir)
        self._metrics = bool(storage_config.enable_storage_metrics)
        self._log = RateLimitedLog(log, 1.0)
        self.pages: HostPages | None = None
        self.page_store: PageStore | None = None
        self.store: TieredStore | None = None
        self.events: Any = None  # events.L3Events when kv_events_endpoint is set on the publishing rank
        self.pools: PoolStores | None = None  # every pool's store, for the v2 calls (pools.py)
        self.hints: kv_hints.HintSink | None = None  # the requests' standard kv_hints (hints.py), once attached
        self.prefetch: WorkerPrefetch | None = None  # where a tier sits below DRAM and prefetch is on
        self._extra_pools: dict[str, Any] = {}  # name -> host pool, the pools besides KV
        self._prefetch_pgs: deque[int] = deque(maxlen=METRICS_KEPT)
        self._backup_pgs: deque[int] = deque(maxlen=METRICS_KEPT)
        self._prefetch_bw: deque[float] = deque(maxlen=METRICS_KEPT)
        self._backup_bw: deque[float] = deque(maxlen=METRICS_KEPT)

    # ---- attach ---------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        # A logical anchor pool (DeepSeek V4's KV anchor, a dummy MLA pool) has no buffer, or never set one.
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise UnsupportedModel(f"the KV host pool {type(mem_pool_host).__name__} holds no KV pages of its own "
                                   "(a logical anchor of a hybrid model); kvtier stores KV pages only")
        self.pages = HostPages(mem_pool_host, interface=self.interface, copy_threads=self.config.copy_threads)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name == PoolName.KV:
            return
        if self.page_store is not None:  # a pool SGLang adds while serving (a dynamic sidecar)
            log.error("kvtier: host pool %r was registered while serving; kvtier sizes its pools' stores at start-up, "
                      "so prefixes that need this pool get no L3 hit", str(host_pool_name))
            return
        self._extra_pools[str(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        if self.pages is None:
            raise RuntimeError("kvtier: SGLang registered no KV host pool before on_host_pools_registered")
        if self.page_store is not None:
            return  # a second burst (re-attach with the same pools)
        if self._extra_pools and self.config.mode != "embedded":
            raise UnsupportedModel(
                f"this model has host pools {list(self._extra_pools)} besides KV; kvtier stores them in mode "
                f"'embedded' only (the node pool holds blocks of one size, the KV page's), not '{self.config.mode}'. "
                "Set \"mode\": \"embedded\" (DRAM and SSD of this server), or run without --hicache-storage-backend")
        ident = self.identity
        namespace = ident.namespace(self.pages.fingerprint)
        share = self.settings.sidecar_share if self._extra_pools else 0.0
        kv_config = pool_config(self.config, KV, 1 - share) if share else self.config
        self.store = open_rank_store(kv_config, self.pages.block_bytes, rank=ident.rank_dir, engine="SGLang",
                                     hint_max_fraction=self.settings.hint_max_fraction)
        naming = None
        if self.settings.kv_events_endpoint and ident.events_publisher:
            from .events import L3Events

            self.events = L3Events(self.settings.kv_events_endpoint, page_size=self.pages.page_size,
                                   attn_dp_rank=ident.dp_rank, replay_endpoint=self.settings.kv_events_replay_endpoint,
                                   topic=self.settings.kv_events_topic,
                                   holds=partial(self.store.contains, local_only=True))  # no master RPC per eviction
            self.store.add_listener(self.events.on_store_event)
            naming = self.events.naming
        kv_staging = max(1, int(self.settings.staging_bytes * (1 - share)))
        self.page_store = PageStore(self.store, namespace, self.pages, kv_staging, naming)
        try:
            self.pools = PoolStores.open(self.page_store, self.mem_pool_host, self._extra_pools, config=self.config,
                                         identity=ident, interface=self.interface, share=share,
                                         staging_bytes=self.settings.staging_bytes)
        except BaseException:
            self.close()
            raise
        # Started once nothing of the start-up can fail any more (a failure above leaves no thread running).
        self.prefetch = WorkerPrefetch.for_store(self.store, self.settings.prefetch)
        self.hints = kv_hints.HintSink(self.store, self.page_store.keys, self.pages.page_size,
                                       self.prefetch.prefetcher if self.prefetch is not None else None)
        kv_hints.attach(self.hints)
        log.info("kvtier HiCache L3 for %s: %s; namespace %s, store %s%s%s%s", ident.describe(), self.pages.describe(),
                 namespace.digest.hex()[:12], [t.name for t in self.store.tiers],
                 "".join(f", {k} {getattr(self.config, k)}" for k in PER_WORKER_KEYS if getattr(self.config, k)),
                 f", KV events on {self.settings.kv_events_endpoint}" if self.events is not None else "",
                 ", prefetch between turns" if self.prefetch is not None else "")

    # ---- the v1 zero-copy calls -------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._guarded("exists", "batch_exists", keys, "reported as 0 hits", 0, lambda store: store.exists(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        start = time.perf_counter()

        def load(store: PageStore) -> list[bool]:
            hit = store.get_pages(keys, host_indices)
            self._sample(self._prefetch_pgs, self._prefetch_bw, sum(hit), start)
            return hit

        return self._guarded("get", "batch_get_v1", keys, "reported as misses", [False] * len(keys), load)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        start = time.perf_counter()

        def save(store: PageStore) -> list[bool]:
            ok = store.set_pages(keys, host_indices, self._hints(extra_info))
            self._sample(self._backup_pgs, self._backup_bw, sum(ok), start)
            self._saved(keys, ok)
            return ok

        return self._guarded("set", "batch_set_v1", keys, "none stored", [False] * len(keys), save)

    # ---- the flat-tensor calls (interface_v1 off) ---------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        start = time.perf_counter()

        def load(store: PageStore) -> list[torch.Tensor | None]:
            if target_locations is None or len(target_locations) != len(keys):
                raise ValueError(f"{len(keys)} page keys need as many target tensors")
            hit = store.get_flat(keys, target_locations)
            self._sample(self._prefetch_pgs, self._prefetch_bw, sum(hit), start)
            return [t if h else None for t, h in zip(target_locations, hit)]

        return self._guarded("get", "batch_get", keys, "reported as misses", [None] * len(keys), load)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        start = time.perf_counter()

        def save(store: PageStore) -> bool:
            if values is None or len(values) != len(keys):
                raise ValueError(f"{len(keys)} page keys need as many page tensors")
            ok = store.set_flat(keys, values)
            self._sample(self._backup_pgs, self._backup_bw, sum(ok), start)
            self._saved(keys, ok)
            return all(ok)

        return self._guarded("set", "batch_set", keys, "none stored", False, save)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the v2 calls: every host pool (KV, Mamba, SWA, indexer, draft; pools.py) ----------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        transfers = list(pool_transfers or ())
        return self._guarded("exists", "batch_exists_v2", keys, "reported as 0 hits", PoolTransferResult.empty(),
                             lambda store: self._pools().exists(keys, transfers))

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        start = time.perf_counter()
        out = self._v2("get", "batch_get_v2", transfers, "reported as misses", lambda: PoolStores.load)
        self._sample_v2(self._prefetch_pgs, self._prefetch_bw, out, start)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        start = time.perf_counter()
        out = self._v2("set", "batch_set_v2", transfers, "none stored",
                       lambda: PoolStores.save(self._hints(extra_info)))
        self._sample_v2(self._backup_pgs, self._backup_bw, out, start)
        return out

    # ---- admin, stats, lifetime ---------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop every page this rank's private tiers hold (DRAM, SSD), from all tiers. Pages a shared pool
        holds that this rank's tiers do not list stay (other servers' pages)."""
        try:
            removed = self._ready().clear()
            log.info("kvtier: cleared %d pages of %s", removed, self.identity.rank_dir)
            return True
        except Exception:
            log.exception("kvtier: clear failed")
            return False
        finally:
            self._publish()

    def get_stats(self) -> StorageMetrics:
        """Pages per call and GB/s of the loads (prefetch) and saves (backup) since the last call (recorded
        with --enable-metrics only, at most METRICS_KEPT each)."""
        metrics = StorageMetrics()
        for src, dst in ((self._prefetch_pgs, metrics.prefetch_pgs), (self._backup_pgs, metrics.backup_pgs),
                         (self._prefetch_bw, metrics.prefetch_bandwidth), (self._backup_bw, metrics.backup_bandwidth)):
            while src:
                dst.append(src.popleft())
        return metrics

    def stats(self) -> dict[str, Any]:
        """kvtier's own view: the store's stats, and the page counters, the kv_hints outcomes
        (``hint_<action>_<outcome>``) and the prefetch counts (``prefetch_*_blocks``, connectors/prefetching.py;
        empty without a Prefetcher) since the last call."""
        store = self._ready()
        pools = self._pools()
        counts = pools.take_counts()
        stores = {p.name: p.store.stats() for p in pools.extra}
        return {"store": store.store.stats(), "pages": counts.pop(KV),
                "pools": {name: {"store": stores.get(name), "pages": c} for name, c in counts.items()},
                "hints": self.hints.outcomes.take() if self.hints is not None else {},
                "prefetch": self.prefetch.take_counters() if self.prefetch is not None else {}}

    def close(self) -> None:
        if self.hints is not None:
            kv_hints.detach(self.hints)
            self.hints = None
        if self.prefetch is not None:  # its last copies end before the store closes
            self.prefetch.close()
            self.prefetch = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.pools is not None:
            self.pools.close()
            self.pools = None
        if self.page_store is not None:
            self.page_store.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        self.page_store = None

    # ---- internals -----------------------------------------------------------------------------------------

    def _ready(self) -> PageStore:
        if self.page_store is None:
            raise RuntimeError("kvtier: the backend has no host pool yet (SGLang calls register_mem_pool_host and "
                               "on_host_pools_registered first) or is closed")
        return self.page_store

    def _pools(self) -> PoolStores:
        self._ready()
        if self.pools is None:  # opened right after the page store, in on_host_pools_registered
            raise RuntimeError("kvtier: the backend's pool stores are not open")
        return self.pools

    def _v2(self, kind: str, call: str, transfers: list[PoolTransfer], failed: str,
            mover: Callable[[], Callable[..., list[bool]]]) -> dict[str, list[bool]]:
        """One of SGLang's v2 data calls, pool by pool (``mover()`` makes the per-pool move: bad hints fail the
        call, inside the guard): a pool that fails answers all False (logged, rate-limited, as ``kind``), the
        others go on; never raised into SGLang."""
        def on_error(pool: str, e: BaseException) -> None:
            self._log(f"{kind}:{pool}", logging.ERROR, "kvtier: %s of pool %s failed (%s); %s", call, pool, e, failed,
                      exc_info=not isinstance(e, (KeyError, ValueError)))
        try:
            return self._pools().transfer(transfers, mover(), on_error)
        except Exception:
            self._log(kind, logging.ERROR, "kvtier: %s failed; %s", call, failed, exc_info=True)
            return {t.name: [False] * len(t.keys or ()) for t in transfers}
        finally:
            self._publish()

    def _guarded(self, kind: str, call: str, keys: list[str], failed: str, fallback: T,
                 run: Callable[[PageStore], T]) -> T:
        """``run`` on the page store, for one of SGLang's data calls: with checked page keys, any failure logged
        (as ``kind``, rate-limited) and answered by ``fallback``, never raised into SGLang; the KV events the
        call produced published either way."""
        try:
            store = self._ready()
            if not page_keys_ok(keys):
                raise ValueError("page keys must be non-empty strings")
            return run(store)
        except Exception:
            self._log(kind, logging.ERROR, "kvtier: %s of %d pages failed; %s", call, len(keys), failed,
                      exc_info=True)
            return fallback
        finally:
            self._publish()

    def _hints(self, extra_info: HiCacheStorageExtraInfo | None) -> AgentHints | None:
        if extra_info is None or not extra_info.extra_info or self.settings.hint_max_fraction <= 0:
            return None
        return parse_hints(extra_info.extra_info, None, "an SGLang storage call")

    def _saved(self, keys: list[str], ok: list[bool]) -> None:
        """Pages SGLang just stored: the Pins of requests that wait for them lease them (hints.py)."""
        if self.hints is not None:
            self.hints.on_saved(keys, ok)

    def _sample(self, pages: deque[int], bandwidth: deque[float], n: int, start: float,
                nbytes: int | None = None) -> None:
        if self._metrics and n and self.pages is not None:
            pages.append(n)
            moved = n * self.pages.block_bytes if nbytes is None else nbytes
            bandwidth.append(moved / max(time.perf_counter() - start, 1e-9) / GB)

    def _sample_v2(self, pages: deque[int], bandwidth: deque[float], out: dict[str, list[bool]], start: float) -> None:
        if self._metrics and self.pools is not None:
            sizes = {name: pool.pages.block_bytes for name, pool in self.pools.pools.items()}
            n = sum(sum(ok) for ok in out.values())
            self._sample(pages, bandwidth, n, start, sum(sum(ok) * sizes.get(str(name), 0) for name, ok in out.items()))

    def _publish(self) -> None:
        if self.events is not None:
            try:
                self.events.publish()
            except Exception:
                self._log("events", logging.ERROR, "kvtier: publishing L3 KV events failed", exc_info=True)
