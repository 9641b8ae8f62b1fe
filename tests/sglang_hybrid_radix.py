"""SGLang 0.5.23's whole live cache path for hybrid models on a CPU, for the v2 tests (tests/test_sglang_hybrid.py):
SGLang's UnifiedRadixCache with the model's tree components, SGLang's own assembly of its host pools and
HybridCacheController (hybrid_pool_assembler's strategies), kvtier attached by SGLang's factory, driven as the
scheduler drives it (insert, check_hicache_events, evict, prefetch_from_storage, load_back). Nothing of the tree,
the assembly or the controller is replaced. Replaced, beside sglang_harness.install()'s (torchvision, the MHA/MLA
host pools' GPU copy kernels, pinning), only what needs a GPU or a model file:

* SwaRadixServer (FULL + SWA over an SWAKVPool: 2 sliding-window layers, 1 full): nothing more;
* MambaRadixServer (FULL + MAMBA: HybridReqToTokenPool's MambaPool with 2 Mamba2 layers, HybridLinearKVPool with
  1 full layer, page size 1 as MambaComponent requires without the extra buffer): MambaPoolHost's pinning and JIT
  state copies (torch index copies), and the Mamba chunk size SGLang reads from the HF config (set on the
  server args: 64, SGLang's FLA default);
* DsaRadixServer (FULL over a DSATokenToKVPool: MLA + the DSA indexer, a model that is not hybrid but moves its
  indexer pages through the v2 calls): DSAIndexerPoolHost's pinning and GPU copies (torch index copies).

The test allocates device slots as a request's prefill would and fills them with random KV / state.
"""

from __future__ import annotations

import json
import time
from array import array
from typing import Any

import torch
from sglang_harness import BACKEND_CONFIG, install, load_host_prefix

_installed = False


def install_hybrid() -> None:
    """The replacements above for MambaPoolHost and DSAIndexerPoolHost (idempotent)."""
    global _installed
    install()
    if _installed:
        return
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    for cls in (MambaPoolHost, DSAIndexerPoolHost):  # their __init__ does not go through HostKVCache's
        cls.__init__ = _unpinned(cls.__init__)
    MambaPoolHost.backup_from_device_all_layer = _mamba_backup
    MambaPoolHost.load_to_device_per_layer = _mamba_load
    DSAIndexerPoolHost.backup_from_device_all_layer = _indexer_backup
    DSAIndexerPoolHost.load_to_device_per_layer = _indexer_load
    _installed = True


def _unpinned(init: Any) -> Any:
    def unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    return unpinned


def _mamba_buffers(host: Any) -> Any:
    """(host buffer, device buffer) pairs: page_first host (slots, layers, 1, *state), device (layers, slots, *state)."""
    yield host.temporal_buffer, host.buffer_info.temporal
    yield from zip(host.conv_buffer, host.buffer_info.conv)


def _mamba_backup(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                  io_backend: str = "kernel") -> None:
    hi, di = host_indices.cpu().long(), device_indices.cpu().long()
    for host, dev in _mamba_buffers(self):
        for layer in range(self.num_mamba_layers):
            host[hi, layer, 0] = dev[layer][di]


def _mamba_load(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                layer_id: int, io_backend: str = "kernel", *, is_draft: bool = False) -> None:
    hi, di = host_indices.cpu().long(), device_indices.cpu().long()
    for host, dev in _mamba_buffers(self):
        dev[layer_id][di] = host[hi, layer_id, 0]


def _indexer_backup(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                    io_backend: str) -> None:
    """page_first host (pages, layers, 1, page bytes) from each device layer's (pages, page bytes)."""
    hp, dp = self._get_indexer_page_indices(host_indices.cpu().long(), device_indices.cpu().long())
    for layer, dev in enumerate(self.packed_device_index_buffers):
        self.index_k_with_scale_buffer[hp, layer, 0] = dev[dp]


def _indexer_load(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                  layer_id: int, io_backend: str, *, is_draft: bool = False) -> None:
    hp, dp = self._get_indexer_page_indices(host_indices.cpu().long(), device_indices.cpu().long())
    device_pool.index_k_with_scale_buffer[layer_id][dp] = self.index_k_with_scale_buffer[hp,
                                                                                          self._host_layer_index(layer_id), 0]


class RadixServer:
    """What the three servers share: the server args, SGLang's UnifiedRadixCache over ``params`` with HiCache and
    kvtier, and the scheduler's steps. Subclasses build the device pools and say what a prompt's rows are."""

    page_size = 4

    def _start(self, *, model: str, extra: dict | None, params_of: Any, args_set: dict | None = None) -> None:
        install_hybrid()
        from sglang.srt import runtime_context as rc
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs

        config = {**BACKEND_CONFIG, "prefetch_threshold": self.page_size, "dram_capacity": "16MiB", **(extra or {})}
        args = ServerArgs(
            model_path="dummy", served_model_name=model, device="cpu", page_size=self.page_size,
            enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_mem_layout="page_first",
            hicache_io_backend="kernel", hicache_write_policy="write_through",
            hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(config))
        for key, value in (args_set or {}).items():
            setattr(args, key, value)
        rc.publish(args, role="scheduler")
        self._parallel = rc.get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        self._parallel.__enter__()
        params = params_of()
        self.cache = UnifiedRadixCache(params)
        self.cache.init_hicache(args, params)
        self.backend = self.cache.cache_controller.storage_backend

    def _insert(self, tokens: list[int], value: torch.Tensor, **more: Any) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value, **more))

    def pump(self, done: Any, timeout: float = 30.0) -> bool:
        """Scheduler rounds (check_hicache_events) until ``done()`` or the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.cache.check_hicache_events()
            if done():
                return True
            time.sleep(0.005)
        return False

    def backed_up(self) -> bool:
        return not self.cache.ongoing_backup and not self.cache.ongoing_write_through

    def forget(self, tokens: list[int], **evict: int) -> None:
        """Evict the prompt from the device and the host (L1, L2): only L3 has it."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=len(tokens), **evict))
        self.cache.evict_host(len(tokens))

    def prefetch(self, tokens: list[int], rid: str = "r") -> int:
        """A new request whose prefix is on no device or host here: prefetch it from L3; the tokens loaded."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(handle, match.last_host_node, array("q", tokens))
        if not self.pump(lambda: self.cache.check_prefetch_progress(handle)):
            raise TimeoutError("prefetch did not finish")
        return self.cache.pop_prefetch_loaded_tokens(handle)

    def _load_back(self, tokens: list[int]) -> Any:
        """Host -> device for the prefix the host holds; the device prefix's last node."""
        return load_host_prefix(self.cache, self.pump, tokens)

    def close(self) -> None:
        self.cache.shutdown()
        self.backend.close()
        self._parallel.__exit__(None, None, None)


def _random(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if rows.dtype == torch.uint8:
        return torch.randint(0, 256, rows.shape, generator=g, dtype=torch.uint8)
    return torch.randn(rows.shape, generator=g).to(rows.dtype)


class SwaRadixServer(RadixServer):
    """FULL + SWA components over an SWAKVPool (layers 0-1 sliding-window, window ``window`` tokens; layer 2 full)."""

    def __init__(self, *, extra: dict | None = None, window: int = 8, tokens: int = 512,
                 model: str = "test/swa") -> None:
        install_hybrid()
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        self.window = window
        ps = self.page_size

        def params() -> Any:
            self.kv = SWAKVPool(size=tokens, size_swa=tokens, page_size=ps, dtype=torch.bfloat16, head_num=2,
                                head_dim=8, swa_attention_layer_ids=[0, 1], full_attention_layer_ids=[2],
                                device="cpu", enable_memory_saver=False)
            self.alloc = SWATokenToKVPoolAllocator(tokens, tokens, ps, torch.bfloat16, "cpu", self.kv, need_sort=False)
            r2t = ReqToTokenPool(size=8, max_context_len=4 * tokens, device="cpu", enable_memory_saver=False)
            return CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=self.alloc,
                                   page_size=ps, tree_components=(ComponentType.FULL, ComponentType.SWA),
                                   sliding_window_size=window)

        self._start(model=model, extra=extra, params_of=params)

    def full_layers(self) -> list[torch.Tensor]:
        return [*self.kv.full_kv_pool.k_buffer, *self.kv.full_kv_pool.v_buffer]

    def swa_layers(self) -> list[torch.Tensor]:
        return [*self.kv.swa_kv_pool.k_buffer, *self.kv.swa_kv_pool.v_buffer]

    def insert(self, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A finished prefill: random KV in fresh full and SWA slots (mapped by the allocator's own
        set_full_to_swa_mapping), inserted. Returns the full layers' rows and the SWA layers' rows."""
        full = self.alloc.full_attn_allocator.alloc(len(tokens))
        self.alloc.set_full_to_swa_mapping(full, self.alloc.swa_attn_allocator.alloc(len(tokens)))
        swa = self.alloc.full_to_swa_index_mapping[full].long()
        g = torch.Generator().manual_seed(seed)
        for layers, idx in ((self.full_layers(), full), (self.swa_layers(), swa)):
            for layer in layers:
                layer[idx] = _random(layer[idx], g)
        self._insert(tokens, full)
        return [x[full].clone() for x in self.full_layers()], [x[swa].clone() for x in self.swa_layers()]

    def load_back(self, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The full layers' rows of the device prefix and the SWA layers' rows of its last ``window`` tokens (all
        a sliding-window layer reads)."""
        full = self.cache.path_device_indices(self._load_back(tokens))
        swa = self.alloc.full_to_swa_index_mapping[full[-self.window:]].long()
        return [x[full].clone() for x in self.full_layers()], [x[swa].clone() for x in self.swa_layers()]


class MambaRadixServer(RadixServer):
    """FULL + MAMBA components: 2 Mamba2 layers (HybridReqToTokenPool's MambaPool) and 1 full-attention layer."""

    page_size = 1

    def __init__(self, *, extra: dict | None = None, tokens: int = 512, model: str = "test/mamba") -> None:
        install_hybrid()
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        def params() -> Any:
            shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2,
                                            head_dim=16, state_size=8, conv_kernel=4)
            self.r2t = HybridReqToTokenPool(size=8, mamba_size=16, mamba_spec_state_size=0,
                                            max_context_len=4 * tokens, device="cpu", enable_memory_saver=False,
                                            cache_params=Mamba2CacheParams(shape=shape, layers=[0, 1]),
                                            mamba_layer_ids=[0, 1], enable_mamba_extra_buffer=False,
                                            enable_overlap_schedule=False)
            self.kv = HybridLinearKVPool(size=tokens, dtype=torch.bfloat16, page_size=1, head_num=2, head_dim=8,
                                         full_attention_layer_ids=[2], device="cpu", mamba_pool=self.r2t.mamba_pool)
            self.alloc = PagedTokenToKVPoolAllocator(tokens, 1, torch.bfloat16, "cpu", self.kv, need_sort=False)
            return CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                                   page_size=1, tree_components=(ComponentType.FULL, ComponentType.MAMBA))

        self._start(model=model, extra=extra, params_of=params, args_set={"_mamba_cache_chunk_size": 64})

    def kv_layers(self) -> list[torch.Tensor]:
        return [*self.kv.full_kv_pool.k_buffer, *self.kv.full_kv_pool.v_buffer]

    def states(self) -> list[torch.Tensor]:
        cache = self.r2t.mamba_pool.mamba_cache
        return [cache.temporal, *cache.conv]

    def insert(self, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A finished prefill: random KV in fresh slots and a random state in a fresh state slot (the state after
        the last token), inserted. Returns the KV rows and the state."""
        idx = self.alloc.alloc(len(tokens))
        slot = self.r2t.mamba_allocator.alloc(1)
        g = torch.Generator().manual_seed(seed)
        for layer in self.kv_layers():
            layer[idx] = _random(layer[idx], g)
        for state in self.states():
            state[:, slot] = _random(state[:, slot], g)
        self._insert(tokens, idx, mamba_value=slot)
        return [x[idx].clone() for x in self.kv_layers()], [s[:, slot].clone() for s in self.states()]

    def load_back(self, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The KV rows of the device prefix and the state its last node holds on the device."""
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        node = self._load_back(tokens)
        idx = self.cache.path_device_indices(node)
        slot = self.cache.tree_core.get_component_device_value(node, ComponentType.MAMBA)
        state = [] if slot is None else [s[:, slot.long()].clone() for s in self.states()]
        return [x[idx].clone() for x in self.kv_layers()], state


class DsaRadixServer(RadixServer):
    """FULL over a DSATokenToKVPool (2 MLA layers with DSA indexer pages; page size 64, the indexer's)."""

    page_size = 64

    def __init__(self, *, extra: dict | None = None, tokens: int = 1024, model: str = "test/dsa") -> None:
        install_hybrid()
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        def params() -> Any:
            self.kv = DSATokenToKVPool(tokens, self.page_size, 16, torch.bfloat16, 8, 2, "cpu", 128, False, 24)
            self.alloc = PagedTokenToKVPoolAllocator(tokens, self.page_size, torch.bfloat16, "cpu", self.kv,
                                                     need_sort=False)
            r2t = ReqToTokenPool(size=8, max_context_len=4 * tokens, device="cpu", enable_memory_saver=False)
            return CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=self.alloc,
                                   page_size=self.page_size, tree_components=(ComponentType.FULL,))

        self._start(model=model, extra=extra, params_of=params)

    def _pages(self, idx: torch.Tensor) -> torch.Tensor:
        return idx.reshape(-1, self.page_size)[:, 0] // self.page_size

    def insert(self, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A finished prefill: random MLA KV and indexer pages, inserted. Returns the KV rows and indexer pages."""
        idx = self.alloc.alloc(len(tokens))
        pages = self._pages(idx)
        g = torch.Generator().manual_seed(seed)
        for layer in self.kv.kv_buffer:
            layer[idx] = _random(layer[idx], g)
        for layer in self.kv.index_k_with_scale_buffer:
            layer[pages] = _random(layer[pages], g)
        self._insert(tokens, idx)
        return [x[idx].clone() for x in self.kv.kv_buffer], [x[pages].clone() for x in self.kv.index_k_with_scale_buffer]

    def load_back(self, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        idx = self.cache.path_device_indices(self._load_back(tokens))
        pages = self._pages(idx)
        return [x[idx].clone() for x in self.kv.kv_buffer], [x[pages].clone() for x in self.kv.index_k_with_scale_buffer]
