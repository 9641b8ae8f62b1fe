"""``kvtier bench sglang``: the SGLang backend's set/get GB/s per host layout, beside memcpy of the same bytes.

SGLang's real host pools (``MHATokenToKVPoolHost`` in its 4 layouts on a Llama-3.1-8B-shaped page: 32 layers,
8 KV heads of 128, bf16; ``MLATokenToKVPoolHost`` in its 3 on a DeepSeek-V3-shaped one: 61 layers, 512 + 64;
``--page-size`` 64 tokens by default) and the backend as SGLang's factory builds it. Each round:

- set: ``batch_set_v1`` of fresh pages (SGLang's backup thread);
- get: ``batch_get_v1`` of them into other host pages (SGLang's prefetch IO thread);
- baseline: one ``np.copyto`` of the same number of bytes, in the same round.

``--pools mamba``: the same for a hybrid model's Mamba/GDN state pool (SGLang's ``MambaPoolHost``, page_first, on a
Qwen3-Next-80B-shaped slot: 36 GatedDeltaNet layers of fp32 temporal state 32 x 128 x 128 and bf16 conv state
8192 x 3, ~74 MiB a slot; ``--state-layers`` fewer) through ``batch_set_v2`` / ``batch_get_v2`` (a KV pool of one
page beside it, as SGLang registers both), the pool's store holding ``sidecar_share`` 0.9 of the DRAM.

1 GiB per round by default (as ``kvtier bench tiers``): far above the last-level cache, so both the backend and
the baseline run at memory bandwidth (at 64 MiB on a machine with a 480 MiB L3, both copy from cache).

Copies of a page's bytes per direction (the module docstring of kvtier/connectors/sglang/pagestore.py): with
kvtier's DRAM on top (embedded, distributed) one everywhere: a contiguous page (MLA ``page_first*``) is copied
by the DRAM tier itself, a page of 2 or 2L segments is gathered into / scattered from the DRAM slot directly;
1.0x memcpy is the ceiling. ``--standalone`` runs the same against a kvtier-pool subprocess on this host (the
node pool's shared memory is the top tier): contiguous pages still move once; segmented pages go through
staging rows (two copies: 0.5x is the ceiling). Needs sglang (``.venv-sglang/bin/kvtier bench sglang`` after
``bash tests/run.sh``); on a CPU-only machine without torchvision a placeholder stands in for it (nothing on
this path uses it).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from kvtier.bench.common import gbps, median, print_rows, row, time_once, write_json
from kvtier.units import parse_bytes

SHAPES = {  # layers, kv heads, head dim (MHA); layers, kv_lora_rank, rope dim (MLA)
    "mha": ("llama-3.1-8b", 32, 8, 128),
    "mla": ("deepseek-v3", 61, 512, 64),
}
LAYOUTS = {"mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
           "mla": ("layer_first", "page_first", "page_first_direct")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=int, default=64, help="SGLang --page-size (tokens per page)")
    p.add_argument("--bytes", default="1GiB", help="page bytes moved per round and direction (whole pages); keep it "
                                                  "well above the last-level cache, or every copy runs from cache")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pools", default="mha,mla", help="which host pools: mha, mla, mamba (comma-separated)")
    p.add_argument("--state-layers", type=int, default=36, help="--pools mamba: GatedDeltaNet layers per state slot")
    p.add_argument("--layouts", default="", help="comma-separated host layouts (default: every layout of the pool)")
    p.add_argument("--standalone", action="store_true",
                   help="the node pool (a kvtier-pool subprocess, shared memory) as the top tier instead of DRAM")
    p.add_argument("--json", default=None, help="write the rows here")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    stub_missing_torchvision()
    rows = []
    for kind in [k.strip() for k in args.pools.split(",") if k.strip()]:
        if kind == "mamba":
            rows += _bench_mamba(args)
            continue
        for layout in [x for x in (args.layouts.split(",") if args.layouts else LAYOUTS[kind]) if x]:
            rows += _bench_layout(kind, layout, args)
    tier = "the node pool (kvtier-pool, shared memory)" if args.standalone else "kvtier DRAM"
    print_rows(rows, f"SGLang HiCache L3 backend, page size {args.page_size}, top tier {tier}",
               "np.copyto of the same bytes; 'copies' = copies of each page byte per direction")
    write_json(rows, args.json)
    return 0


def _bench_layout(kind: str, layout: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    ps = args.page_size
    _, layers, a, b = SHAPES[kind]
    page_bytes = layers * ps * (2 * a * b if kind == "mha" else a + b) * 2  # bf16
    n = max(1, parse_bytes(args.bytes) // page_bytes)
    # n source pages, n destination pages (page_head's per-layer views need at least one page per layer).
    host = _host_pool(kind, layout, ps, pages=max(2 * n, layers))
    if sum(host.get_page_buffer_meta(torch.arange(ps))[1]) != page_bytes:
        raise RuntimeError(f"bench {kind} {layout}: the host pool's page is not {page_bytes} B")
    host.kv_buffer.view(torch.uint8).fill_(3)  # touch every page before timing
    src_idx = torch.arange(0, n * ps, dtype=torch.int64)
    dst_idx = torch.arange(n * ps, 2 * n * ps, dtype=torch.int64)
    with ExitStack() as stack:
        # Each round's pages are removed after it: n + 1 slots hold a round (and its one eviction-free put).
        extra: dict[str, Any] = {"dram_capacity": (n + 1) * page_bytes, "dram_prefault": True}
        if args.standalone:
            from kvtier.pool.process import PoolDaemon

            pool = stack.enter_context(PoolDaemon((n + 1) * page_bytes, page_bytes, ipc=True))
            extra = {"mode": "standalone", "pool": pool.endpoint("ipc"), "pool_timeout_ms": 30000}
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=kind == "mla",
            enable_storage_metrics=False, is_page_first_layout=layout == "page_first", model_name=SHAPES[kind][0],
            extra_config={"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang",
                          "class_name": "KVTierHiCacheStorage", "interface_v1": 1, **extra})
        backend = StorageBackendFactory.create_backend("dynamic", config, host)
        backend.register_mem_pool_host(host)
        backend.register_mem_host_pool_v2(host, PoolName.KV)
        backend.on_host_pools_registered()
        stack.callback(backend.close)
        a = np.empty(n * page_bytes, np.uint8)
        a.fill(5)
        b = np.empty_like(a)
        times: dict[str, list[float]] = {"set": [], "get": [], "memcpy": []}
        for rnd in range(args.rounds + 1):
            keys = [f"{rnd:08x}{i:056x}" for i in range(n)]
            ok: list[bool] = []
            hit: list[bool] = []
            t_set = time_once(lambda: ok.extend(backend.batch_set_v1(keys, src_idx)))  # noqa: B023 - called now
            t_get = time_once(lambda: hit.extend(backend.batch_get_v1(keys, dst_idx)))  # noqa: B023
            t_copy = time_once(lambda: np.copyto(b, a))
            if not all(ok) or not all(hit):
                raise RuntimeError(f"bench {kind} {layout}: {ok.count(False)} sets and {hit.count(False)} gets failed")
            backend.store.remove(backend.page_store.keys(keys))  # the next round saves fresh pages
            if rnd == 0:
                _check(host, n, ps)
                continue
            times["set"].append(t_set)
            times["get"].append(t_get)
            times["memcpy"].append(t_copy)
        counts = backend.stats()["pages"]
    nbytes = n * page_bytes
    base = gbps(nbytes, median(times["memcpy"]))
    segments = len(host.get_page_buffer_meta(torch.arange(ps))[0])
    fields = {"pool": kind.upper(), "layout": layout, "segments": segments, "pages": n, "block_bytes": page_bytes}
    copies = {"set": 2 if counts["saved_staged"] else 1, "get": 2 if counts["loaded_staged"] else 1}
    return [row({**fields, "op": op, "copies": copies[op]}, gbps(nbytes, median(times[op])), base)
            for op in ("set", "get")]


MAMBA_SHAPE = ("qwen3-next-80b", (32, 128, 128), (8192, 3))  # temporal (v heads, k dim, v dim) fp32; conv bf16


def _bench_mamba(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Mamba state slots through the v2 calls, beside np.copyto of the same bytes (see the module docstring)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    name, temporal, conv = MAMBA_SHAPE
    layers = args.state_layers
    slot_bytes = layers * (int(np.prod(temporal)) * 4 + int(np.prod(conv)) * 2)
    n = max(1, parse_bytes(args.bytes) // slot_bytes)
    info = MambaStateBufferInfo(temporal=torch.empty(layers, 1, *temporal, dtype=torch.float32),
                                conv=(torch.empty(layers, 1, *conv, dtype=torch.bfloat16),))
    with host_memory_budget_scope(1 << 50):  # as _host_pool: a bench knows its size
        host = MambaPoolHost(info, 2.0 * n, 0, device_capacity=1, pin_memory=False, device="cpu", layout="page_first")
        kv = _host_pool("mha", "page_first", 1, pages=1)  # the KV pool SGLang registers beside it (unused)
    for buf in host.kv_buffer:
        buf.view(torch.uint8).fill_(3)  # touch every slot before timing
    src, dst = torch.arange(0, n, dtype=torch.int64), torch.arange(n, 2 * n, dtype=torch.int64)
    share = 0.9
    with ExitStack() as stack:
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name=name,
            extra_config={"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang",
                          "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "sidecar_share": share,
                          "dram_capacity": int((n + 1) * slot_bytes / share) + 1, "dram_prefault": True})
        backend = StorageBackendFactory.create_backend("dynamic", config, kv)
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(host, PoolName.MAMBA)
        backend.on_host_pools_registered()
        stack.callback(backend.close)
        pool = backend.pools.pools[str(PoolName.MAMBA)]
        if pool.pages.block_bytes != slot_bytes:
            raise RuntimeError(f"bench mamba: a state slot is {pool.pages.block_bytes} B, not {slot_bytes} B")
        a = np.empty(n * slot_bytes, np.uint8)
        a.fill(5)
        b = np.empty_like(a)
        times: dict[str, list[float]] = {"set": [], "get": [], "memcpy": []}
        for rnd in range(args.rounds + 1):
            keys = [f"{rnd:08x}{i:056x}" for i in range(n)]
            out: dict[str, list[bool]] = {}
            t_set = time_once(lambda: out.update(set=backend.batch_set_v2(  # noqa: B023 - called now
                [PoolTransfer(name=PoolName.MAMBA, host_indices=src, keys=keys)])[PoolName.MAMBA]))  # noqa: B023
            t_get = time_once(lambda: out.update(get=backend.batch_get_v2(  # noqa: B023
                [PoolTransfer(name=PoolName.MAMBA, host_indices=dst, keys=keys)])[PoolName.MAMBA]))  # noqa: B023
            t_copy = time_once(lambda: np.copyto(b, a))
            if not all(out["set"]) or not all(out["get"]):
                raise RuntimeError(f"bench mamba: {out['set'].count(False)} sets and {out['get'].count(False)} gets "
                                   "failed")
            pool.store.remove(pool.page_store.keys(keys))  # the next round saves fresh slots
            if rnd == 0:
                _check(host, n, 1)
                continue
            times["set"].append(t_set)
            times["get"].append(t_get)
            times["memcpy"].append(t_copy)
        counts = backend.stats()["pools"][str(PoolName.MAMBA)]["pages"]
    nbytes = n * slot_bytes
    base = gbps(nbytes, median(times["memcpy"]))
    fields = {"pool": "MAMBA", "layout": "page_first", "segments": pool.pages.segments, "pages": n,
              "block_bytes": slot_bytes}
    copies = {"set": 2 if counts["saved_staged"] else 1, "get": 2 if counts["loaded_staged"] else 1}
    return [row({**fields, "op": op, "copies": copies[op]}, gbps(nbytes, median(times[op])), base)
            for op in ("set", "get")]


def _host_pool(kind: str, layout: str, page_size: int, pages: int) -> Any:
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    _, layers, a, b = SHAPES[kind]
    # SGLang sizes host pools against free memory minus a 10 GiB reserve for a server; a bench knows its size.
    with host_memory_budget_scope(1 << 50):
        return _new_host_pool(kind, layout, page_size, pages, layers, a, b)


def _new_host_pool(kind: str, layout: str, page_size: int, pages: int, layers: int, a: int, b: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = dict(pin_memory=False, device="cpu", host_token_capacity=(pages + 1) * page_size)
    if kind == "mha":
        dev = MHATokenToKVPool(size=page_size, page_size=page_size, dtype=torch.bfloat16, head_num=a, head_dim=b,
                               layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        return get_mha_host_pool_cls(info)(info, 1.0, 0, page_size, layout, device_capacity_tokens=dev.size,
                                           start_layer=dev.start_layer, end_layer=dev.end_layer, **common)
    dev = MLATokenToKVPool(size=page_size, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=a,
                           qk_rope_head_dim=b, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout, device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=layers,
                                override_kv_cache_dim=dev.kv_cache_dim, **common)


def _check(host: Any, n: int, ps: int) -> None:
    """After the warm-up round: every destination page holds its source page's bytes."""
    import ctypes

    for p in (0, n // 2, n - 1):
        src = host.get_page_buffer_meta(torch.arange(p * ps, (p + 1) * ps))
        dst = host.get_page_buffer_meta(torch.arange((n + p) * ps, (n + p + 1) * ps))
        for (sa, size), da in zip(zip(*src), dst[0]):
            if ctypes.string_at(sa, size) != ctypes.string_at(da, size):
                raise RuntimeError(f"bench: page {p} came back with other bytes")


class _Placeholder:
    """Anything a module-level torchvision import asks for (a class base, a default argument)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Placeholder(f"{self._name}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+kvtier-placeholder"

        def attr(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder(f"{spec.name}.{name}")

        module.__getattr__ = attr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def stub_missing_torchvision() -> None:
    """Where torchvision is not installed (a CPU-only machine: PyPI's build is CUDA-only and fails to load beside
    the CPU torch), every ``torchvision.*`` import gets a placeholder module. SGLang imports torchvision at
    module level for vision models it never uses on the HiCache path. Call before importing SGLang; idempotent."""
    if importlib.util.find_spec("torchvision") is None and not any(
            isinstance(f, _TorchvisionPlaceholder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionPlaceholder())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
