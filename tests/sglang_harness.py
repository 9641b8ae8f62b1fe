"""SGLang 0.5.23's real cache code on a CPU, for the SGLang backend's tests (SGLANG-HICACHE.md, "Running SGLang's
own cache code on a CPU").

What is replaced, and only that (everything of kvtier's and the rest of SGLang's is real):
* torchvision: PyPI's build is CUDA-only and fails to load beside the CPU torch; nothing on the HiCache path
  uses it, so every ``torchvision.*`` import gets a placeholder module (``kvtier.bench.sglang``'s, installed
  before SGLang is imported);
* the host pools' device<->host copies (``backup_from_device_all_layer``, ``load_to_device_per_layer``): their
  ``transfer_kv_*`` kernels exist only on CUDA/HIP/XPU builds; here they are torch index copies, per layout;
* host pinning (cudaHostRegister needs CUDA): host pools are built with pin_memory off;
* the host RAM SGLang books a host pool against (free RAM less a 10 GiB reserve, often negative on this shared
  machine, and then no pool builds): the test's pools (a few MiB) are built inside SGLang's own
  ``host_memory_budget_scope`` with an explicit budget (``host_budget``).

``sglang_available()`` says whether the sglang package is importable (tests/run.sh installs it into
.venv-sglang and runs these tests there); the tests skip with that reason elsewhere.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch

SKIP_REASON = ("sglang is not installed in this venv: tests/run.sh installs sglang 0.5.23 into .venv-sglang and runs "
               "the SGLang tests there")
BACKEND_CONFIG = {"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang",
                  "class_name": "KVTierHiCacheStorage", "interface_v1": 1}
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


_installed = False


def install() -> None:
    """The three replacements above; idempotent. Call before importing anything of SGLang."""
    global _installed
    if _installed:
        return
    from kvtier.bench.sglang import stub_missing_torchvision

    stub_missing_torchvision()
    from sglang.srt.mem_cache.pool_host import base
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    init = base.HostKVCache.__init__

    def unpinned(self: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, **kwargs)

    base.HostKVCache.__init__ = unpinned
    for cls in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        cls.backup_from_device_all_layer = _backup
        cls.load_to_device_per_layer = _load
    _installed = True


HOST_BUDGET = 1 << 30  # bytes of host RAM the test's host pools may book (host_budget)


def host_budget() -> Any:
    """SGLang's host_memory_budget_scope with HOST_BUDGET: build host pools inside it."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(HOST_BUDGET)


def _host_rows(host: Any, part: int, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(tensor, index) of tokens ``idx`` of one layer's K (part 0) or V (1) in the host pool, per layout."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    ps, layout = host.page_size, host.layout
    buf = host.kv_buffer if isinstance(host, MLATokenToKVPoolHost) else host.kv_buffer[part]
    if layout == "layer_first":
        return buf, (layer, idx)
    if layout == "page_first":
        return buf, (idx, layer)
    if layout == "page_first_direct":
        return buf, (idx // ps, layer, idx % ps)
    if layout == "page_head":
        return buf, (idx // ps, slice(None), idx % ps, layer)
    raise ValueError(f"no test copy for host layout {layout}")


def _device_layer(host: Any, device_pool: Any, part: int, layer: int) -> torch.Tensor:
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if isinstance(host, MLATokenToKVPoolHost):
        return device_pool.kv_buffer[layer]
    return (device_pool.k_buffer if part == 0 else device_pool.v_buffer)[layer]


def _parts(host: Any) -> tuple[int, ...]:
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return (0,) if isinstance(host, MLATokenToKVPoolHost) else (0, 1)


def _backup(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
            io_backend: str) -> None:
    hi, di = host_indices.cpu().long(), device_indices.cpu().long()
    for layer in range(self.layer_num):
        for part in _parts(self):
            buf, ix = _host_rows(self, part, layer, hi)
            buf[ix] = _device_layer(self, device_pool, part, layer)[di]


def _load(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
          io_backend: str, *, is_draft: bool = False) -> None:
    hi, di = host_indices.cpu().long(), device_indices.cpu().long()
    for part in _parts(self):
        buf, ix = _host_rows(self, part, layer_id, hi)
        _device_layer(self, device_pool, part, layer_id)[di] = buf[ix]


# ---- level 1: real host pools and the real factory ----------------------------------------------------------


def device_pool(kind: str, *, tokens: int = 256, page_size: int = 4, layers: int = 3,
                dtype: torch.dtype = torch.bfloat16, heads: int = 2, head_dim: int = 8, kv_lora_rank: int = 16,
                rope_dim: int = 8) -> Any:
    install()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        return MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=heads, head_dim=head_dim,
                                layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    return MLATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
                            qk_rope_head_dim=rope_dim, layer_num=layers, device="cpu", enable_memory_saver=False)


def host_pool(dev: Any, layout: str, *, ratio: float = 2.0) -> Any:
    """SGLang's real MHATokenToKVPoolHost / MLATokenToKVPoolHost over ``dev`` in ``layout``."""
    install()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                  end_layer=dev.end_layer)
    with host_budget():
        if isinstance(dev, MLATokenToKVPool):
            return MLATokenToKVPoolHost(info, ratio, 0, dev.page_size, layout, target_layer_num=dev.layer_num,
                                        override_kv_cache_dim=dev.kv_cache_dim, **common)
        return get_mha_host_pool_cls(info)(info, ratio, 0, dev.page_size, layout, **common)


def storage_config(extra: dict, *, model: str = "test/model", tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   metrics: bool = False, pp_rank: int = 0, pp_size: int = 1) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=False, model_name=model,
                                extra_config={**BACKEND_CONFIG, **extra})


def make_backend(host: Any, extra: dict, **config: Any) -> Any:
    """The backend as SGLang builds it: StorageBackendFactory ("dynamic"), then the attach calls in SGLang's
    order (register_mem_pool_host, register_mem_host_pool_v2(KV), on_host_pools_registered)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cfg = storage_config(extra, mla=isinstance(host, MLATokenToKVPoolHost), **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.on_host_pools_registered()
    return backend


def fill_pages(host: Any, pages: list[int], seed: int) -> list[bytes]:
    """Random bytes into the host pages ``pages`` (page p: tokens [p * ps, (p + 1) * ps)), written through the
    pool's own segment table; returns each page's bytes in segment order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in pages:
        ptrs, sizes = host.get_page_buffer_meta(page_indices(host, [p]))
        data = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g).numpy().tobytes()
        offset = 0
        for address, n in zip(ptrs, sizes):
            ctypes.memmove(address, data[offset : offset + n], n)
            offset += n
        out.append(data)
    return out


def page_indices(host: Any, pages: list[int]) -> torch.Tensor:
    ps = host.page_size
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def page_bytes(host: Any, pages: list[int]) -> list[bytes]:
    """Each page's bytes, read through the pool's own segment table (the ground truth a backend must keep)."""
    out = []
    for p in pages:
        ptrs, sizes = host.get_page_buffer_meta(page_indices(host, [p]))
        out.append(b"".join(ctypes.string_at(a, n) for a, n in zip(ptrs, sizes)))
    return out


# ---- level 2: UnifiedRadixCache + HybridCacheController ---------------------------------------------------


class RadixServer:
    """One "server": SGLang's real UnifiedRadixCache with HiCache and a storage backend on CPU pools, driven as the
    scheduler drives it (insert, check_hicache_events, prefetch_from_storage, load_back)."""

    def __init__(self, *, kind: str = "mha", layout: str = "page_first", extra: dict | None = None,
                 backend: str = "dynamic", page_size: int = 4, tokens: int = 512, interface_v1: int = 1,
                 model: str = "test/model", layers: int = 3) -> None:
        install()
        from sglang.srt import runtime_context as rc
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs

        config = {**BACKEND_CONFIG, "interface_v1": interface_v1, "prefetch_threshold": page_size, **(extra or {})}
        self.server_args = ServerArgs(
            model_path="dummy", served_model_name=model, device="cpu", page_size=page_size,
            enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend="kernel",
            hicache_write_policy="write_through", hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend=backend, hicache_storage_backend_extra_config=json.dumps(config))
        rc.publish(self.server_args, role="scheduler")
        self._parallel = rc.get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        self._parallel.__enter__()
        self.kind, self.page_size = kind, page_size
        self.dev = device_pool(kind, tokens=tokens, page_size=page_size, layers=layers)
        alloc = PagedTokenToKVPoolAllocator(tokens, page_size, self.dev.dtype, "cpu", self.dev, need_sort=False)
        self.alloc = alloc
        r2t = ReqToTokenPool(size=8, max_context_len=4 * tokens, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                 page_size=page_size, tree_components=(ComponentType.FULL,))
        self.cache = UnifiedRadixCache(params)
        with host_budget():
            self.cache.init_hicache(self.server_args, params)
        self.backend = self.cache.cache_controller.storage_backend

    def device_layers(self) -> list[torch.Tensor]:
        return list(self.dev.kv_buffer) if self.kind == "mla" else [*self.dev.k_buffer, *self.dev.v_buffer]

    def insert(self, tokens: list[int], seed: int) -> list[torch.Tensor]:
        """Compute-and-cache ``tokens``: random KV in freshly allocated device slots, inserted into the tree
        (write_through backs it up to host, then to L3). Returns each device layer's rows of them."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        idx = self.alloc.alloc(len(tokens))
        g = torch.Generator().manual_seed(seed)
        for layer in self.device_layers():
            layer[idx] = torch.randn(layer[idx].shape, generator=g).to(layer.dtype)
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=idx))
        return [layer[idx].clone() for layer in self.device_layers()]

    def pump(self, done: Callable[[], bool], timeout: float = 60.0) -> bool:
        """Run scheduler rounds (check_hicache_events) until ``done()`` or the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self.cache.check_hicache_events()
            if done():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def backend_keys(self, tokens: list[int]) -> list[str]:
        """SGLang's page keys of a plain prompt (kvtier's SglangPageHasher, checked against SGLang's by use)."""
        from kvtier.keys.hashers import SglangPageHasher

        return SglangPageHasher(self.page_size).hashes(tokens)

    def backed_up(self) -> bool:
        return not self.cache.ongoing_backup and not self.cache.ongoing_write_through

    def prefetch(self, tokens: list[int], rid: str = "r", timeout: float = 60.0) -> int:
        """What the scheduler does for a new request whose prefix is not on this server: prefetch it from L3
        into the host pool; returns the tokens loaded."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(handle, match.last_host_node, array("q", tokens))
        if not self.pump(lambda: self.cache.check_prefetch_progress(handle), timeout):
            raise TimeoutError(f"prefetch of {len(tokens)} tokens did not finish within {timeout} s")
        return self.cache.pop_prefetch_loaded_tokens(handle)

    def load_back(self, tokens: list[int]) -> list[torch.Tensor]:
        """Host -> device for the prefix of ``tokens`` the host holds; returns each device layer's rows of the
        whole matched device prefix."""
        idx = self.cache.path_device_indices(load_host_prefix(self.cache, self.pump, tokens))
        return [layer[idx].clone() for layer in self.device_layers()]

    def close(self) -> None:
        self.cache.shutdown()
        from kvtier.connectors.sglang import KVTierHiCacheStorage

        if isinstance(self.backend, KVTierHiCacheStorage):
            self.backend.close()
        self._parallel.__exit__(None, None, None)


def load_host_prefix(cache: Any, pump: Callable[[Callable[[], bool]], Any], tokens: list[int]) -> Any:
    """Host -> device, in the radix cache ``cache``, for the prefix of ``tokens`` the host holds (``pump`` runs
    the cache's controller until its condition holds); returns the matched device prefix's last node."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", tokens))
    match = cache.match_prefix(MatchPrefixParams(key=key))
    if match.host_hit_length:
        if not cache.load_back(match.best_match_node):
            raise RuntimeError("load_back refused")
        cache.ready_to_load_host_cache()
        pump(lambda: not cache.ongoing_load_back)
    return cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
