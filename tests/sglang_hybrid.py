"""SGLang 0.5.23's HybridCacheController on a CPU with a hybrid model's host pools, below the radix tree, for the v2
tests (tests/test_sglang_hybrid.py; the whole live path with the tree is tests/sglang_hybrid_radix.py).
Everything is SGLang's real code except what sglang_harness.py replaces (torchvision, GPU copy kernels, pinning).

HybridController (KV + Mamba state, KV + SWA, optionally a KV-derived indexer pool):

* the host pools: SGLang's MHATokenToKVPoolHost (KV, and SWA: SGLang builds the SWA host pool as an MHA host
  pool over the sliding-window layers' device pool, hybrid_pool_assembler.build_hybrid_swa_group) and
  MambaPoolHost (over CPU state tensors), grouped by SGLang's HostPoolGroup / build_pool_entry;
* the controller: SGLang's HybridCacheController with storage backend "dynamic" (kvtier built by SGLang's
  factory, attached with every pool: register_mem_pool_host, register_mem_host_pool_v2 per pool,
  on_host_pools_registered), and its own backup, prefetch, IO and sync threads, which make the v2 calls;
* what the test does in the radix tree's place (UnifiedRadixCache with Mamba or SWA components needs the
  model's request state, which does not run here): it builds the PoolTransfers exactly as SGLang's components
  build them (unified_cache/components/mamba.py and swa.py: BACKUP_STORAGE one Mamba state keyed by the node's
  last page key, the SWA window's pages keyed by their page keys; PREFETCH placeholders) and does the
  scheduler's step between the hit query and the IO thread (UnifiedRadixCache._try_alloc_storage_hit and
  _alloc_prefetch_aux_staging: allocate the KV bounce and the sidecar staging, queue the operation).
"""

from __future__ import annotations

import ctypes
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang_harness import BACKEND_CONFIG, device_pool, host_pool, install

PS = 4  # tokens per page


def page_keys(tokens: list[int], page_size: int = PS) -> list[str]:
    """SGLang's own storage page keys of a plain prompt (get_storage_hash_str)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=page_size)


def write_random(pool: Any, indices: torch.Tensor, seed: int) -> list[bytes]:
    """Random bytes into each page of ``pool`` at ``indices`` (page_size slots each), through the pool's own
    segment table; returns each page's bytes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    ps = pool.page_size
    for i in range(0, len(indices), ps):
        ptrs, sizes = pool.get_page_buffer_meta(indices[i:i + ps])
        data = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g).numpy().tobytes()
        offset = 0
        for address, n in zip(ptrs, sizes):
            ctypes.memmove(address, data[offset:offset + n], n)
            offset += n
        out.append(data)
    return out


def read_pages(pool: Any, indices: torch.Tensor) -> list[bytes]:
    ps = pool.page_size
    out = []
    for i in range(0, len(indices), ps):
        ptrs, sizes = pool.get_page_buffer_meta(indices[i:i + ps])
        out.append(b"".join(ctypes.string_at(a, n) for a, n in zip(ptrs, sizes)))
    return out


def mamba_host(*, slots: int = 8, layers: int = 2, temporal_dtype: torch.dtype = torch.float32,
               conv_dtype: torch.dtype = torch.bfloat16, side_state: bool = False) -> Any:
    """SGLang's MambaPoolHost over CPU state tensors (page_first: one slot = one page of temporal + conv state).
    ``side_state``: a registered per-slot side buffer (as a Mamba model with extra checkpoint state has)."""
    install()
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    extra = (torch.zeros(slots, 6, dtype=torch.int32),) if side_state else ()
    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, 4, 8, dtype=temporal_dtype),
                                conv=(torch.zeros(layers, slots, 3, 16, dtype=conv_dtype),),
                                extra_checkpoint_buffers=extra)
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


@dataclass
class Saved:
    keys: list[str]  # SGLang's page keys of the prompt
    kv: list[bytes]  # each page's KV bytes as backed up
    sidecar: dict[int, list[bytes]] = field(default_factory=dict)  # pages -> the sidecar pages saved at that node end
    indexer: list[bytes] = field(default_factory=list)  # each page's indexer bytes (KV-derived pool), if any


@dataclass
class Loaded:
    hit_tokens: int  # the rank-agreed hit the prefetch thread published (after batch_exists_v2)
    completed_tokens: int  # the KV tokens the IO thread loaded
    pool_hits: dict[str, int]  # the sidecar pages the IO thread loaded (batch_get_v2), per pool
    kv: list[bytes]  # the KV pages now in the host bounce
    sidecar: list[bytes]  # the sidecar pages now in its staging
    indexer: list[bytes] = field(default_factory=list)  # the indexer pages now beside the KV bounce


class HybridController:
    """One rank: a KV host pool plus one trailing sidecar pool (``sidecar`` "mamba" or "swa") and, with
    ``indexer``, a KV-derived all-pages pool (INDEXER, indexed by the KV host indices as DSA's indexer is; here
    an MHA host pool of one layer), SGLang's HybridCacheController over them, kvtier attached as its L3 backend."""

    def __init__(self, sidecar: str, *, extra: dict | None = None, window_pages: int = 2, layers: int = 2,
                 mamba: dict | None = None, model: str = "test/hybrid", tokens: int = 512,
                 indexer: bool = False) -> None:
        install()
        from sglang.srt import runtime_context as rc
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.server_args import ServerArgs

        self.config = {**BACKEND_CONFIG, "prefetch_threshold": PS, "dram_capacity": "4MiB", **(extra or {})}
        server_args = ServerArgs(
            model_path="dummy", served_model_name=model, device="cpu", page_size=PS, enable_hierarchical_cache=True,
            hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel",
            hicache_write_policy="write_through", hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(self.config))
        rc.publish(server_args, role="scheduler")
        self._parallel = rc.get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        self._parallel.__enter__()
        self.sidecar = sidecar
        self.window_pages = window_pages if sidecar == "swa" else 1  # Mamba: one state, at a node's end
        kv_dev = device_pool("mha", tokens=tokens, page_size=PS, layers=layers)
        self.kv = host_pool(kv_dev, "page_first")
        alloc = PagedTokenToKVPoolAllocator(tokens, PS, kv_dev.dtype, "cpu", kv_dev, need_sort=False)
        if sidecar == "mamba":
            self.name = PoolName.MAMBA
            self.side = mamba_host(layers=layers, **(mamba or {}))
            side_dev = None
        elif sidecar == "swa":
            self.name = PoolName.SWA
            side_dev = device_pool("mha", tokens=tokens, page_size=PS, layers=1, heads=1)
            self.side = host_pool(side_dev, "page_first")
        else:
            raise ValueError(f"sidecar must be mamba or swa, got {sidecar!r}")
        kv_layers = {i: i for i in range(layers)}
        side_layers = {layers + i: i for i in range(1 if sidecar == "swa" else layers)}
        top = layers + len(side_layers)
        entries = [
            build_pool_entry(name=PoolName.KV, host_pool=self.kv, device_pool=kv_dev, layer_mapping=kv_layers,
                             transfer_layer_id_max=top + indexer, is_anchor=True),
            build_pool_entry(name=self.name, host_pool=self.side, device_pool=side_dev, layer_mapping=side_layers,
                             transfer_layer_id_max=top + indexer)]
        self.indexer = None
        if indexer:
            index_dev = device_pool("mha", tokens=tokens, page_size=PS, layers=1, heads=1, head_dim=4)
            self.indexer = host_pool(index_dev, "page_first")
            assert self.indexer.size == self.kv.size  # it shares the KV pool's host indices
            entries.append(build_pool_entry(name=PoolName.INDEXER, host_pool=self.indexer, device_pool=index_dev,
                                            layer_mapping={top: 0}, transfer_layer_id_max=top + 1))
            top += 1
        group = HostPoolGroup(entries)
        self.cc = HybridCacheController(alloc, group, PS, None, threading.Event(), write_policy="write_through",
                                        io_backend="kernel", storage_backend="dynamic", prefetch_threshold=PS,
                                        model_name=model, storage_backend_extra_config=self.config,
                                        transfer_layer_id_max=top)
        self.backend = self.cc.storage_backend
        self._rid = 0

    @staticmethod
    def keys(tokens: list[int]) -> list[str]:
        return page_keys(tokens)

    # ---- backup: one radix node at a time, as the tree writes through ---------------------------------------

    def save(self, tokens: list[int], node_ends: list[int], seed: int, *, with_sidecar: bool = True,
             with_indexer: bool = True) -> Saved:
        """Back up ``tokens`` as the radix tree does for nodes ending at the pages ``node_ends`` (e.g. [4, 8]: two
        nodes, pages 0-3 and 4-7): KV pages through batch_set_v1, and with each node its sidecar (Mamba: the
        state at the node's end; SWA: the window's last pages) through batch_set_v2. Waits for the acks."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        keys = self.keys(tokens)
        saved = Saved(keys, [])
        start = 0
        for n, end in enumerate(node_ends):
            pages = end - start
            kv_idx = self.kv.alloc(pages * PS)
            saved.kv += write_random(self.kv, kv_idx, seed * 100 + n)
            extra = []
            if self.indexer is not None and with_indexer:
                saved.indexer += write_random(self.indexer, kv_idx, seed * 100 + 80 + n)
                # a KV-derived sidecar: the controller fills its keys and host indices from the KV operation
                extra.append(PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV,
                                          hit_policy=PoolHitPolicy.ALL_PAGES))
            if with_sidecar:
                window = min(self.window_pages, pages)
                side_idx = self.side.alloc(window * self.side.page_size)
                saved.sidecar[end] = write_random(self.side, side_idx, seed * 100 + 50 + n)
                # components/mamba.py and swa.py, BACKUP_STORAGE: the node's last page keys and its host slots
                extra.append(PoolTransfer(name=self.name, host_indices=side_idx, keys=keys[end - window:end],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES))
            op_id = self.cc.write_storage(kv_idx, tokens[start * PS:end * PS], hash_value=keys[start:end],
                                          prefix_keys=keys[:start] or None, extra_pools=extra or None)
            op = self._wait(self.cc.ack_backup_queue, lambda o: o.id == op_id)
            if op.completed_tokens != pages * PS:
                raise AssertionError(f"node ending at page {end}: {op.completed_tokens} of {pages * PS} backed up")
            start = end
        return saved

    # ---- prefetch: the prefetch thread's query, the scheduler's allocation, the IO thread's loads ------------

    def load(self, tokens: list[int], timeout: float = 30.0) -> Loaded:
        """Prefetch ``tokens`` from L3 with the sidecar's PREFETCH transfer (placeholders), as a new request
        whose prefix is on no device or host of this rank."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        self._rid += 1
        transfer = PoolTransfer(name=self.name, keys=["__placeholder__"] * self.window_pages,
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        extra = [transfer]
        if self.indexer is not None:
            extra.append(PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV,
                                      hit_policy=PoolHitPolicy.ALL_PAGES))
        op = self.cc.prefetch(CacheRequestHandle(f"r{self._rid}", 0), list(tokens), None, None, extra_pools=extra)
        op = self._wait(self.cc.prefetch_hit_queue, lambda o: o is op, timeout)
        hit = op.storage_hit_count
        if hit == 0:
            return Loaded(0, 0, {}, [], [])
        # UnifiedRadixCache._try_alloc_storage_hit + _alloc_prefetch_aux_staging
        host_indices, alloc_len = self.cc.allocate_storage_hit(op, hit, allow_partial=True, min_tokens=PS,
                                                               evict_host=lambda n: 0)
        assert host_indices is not None and alloc_len == hit, (alloc_len, hit)
        staging = min(len(transfer.keys), hit // PS) * self.side.page_size
        transfer.host_indices = self.side.alloc(staging)
        op.host_indices = host_indices
        op.hash_value = op.hash_value[:hit // PS]
        self.cc.prefetch_buffer.put(op)
        completed, pool_hits = 0, {}
        while True:
            ack = self._wait(self.cc.ack_prefetch_queue, lambda a: a.operation is op, timeout)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.pool_hits:
                pool_hits = {k: v for k, v in ack.pool_hits.items() if v}
            if ack.completed_req:
                break
        side = transfer.host_indices  # _sync_trailing_keys may have shrunk it to the hit's window
        return Loaded(hit, completed, pool_hits, read_pages(self.kv, host_indices[:completed]),
                      read_pages(self.side, side) if side is not None else [],
                      read_pages(self.indexer, host_indices[:completed]) if self.indexer is not None else [])

    @staticmethod
    def _wait(q: queue.Queue, match: Any, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                item = q.get(timeout=0.05)
            except queue.Empty:
                continue
            if match(item):
                return item
        raise TimeoutError("SGLang's controller did not answer in time")

    def close(self) -> None:
        self.cc.detach_storage_backend()  # stops SGLang's storage threads and closes the backend
        self._parallel.__exit__(None, None, None)

