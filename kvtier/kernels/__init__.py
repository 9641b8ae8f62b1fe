"""Packed-block copy kernels: gather engine paged KV into packed blocks (BlockLayout), scatter them back.

    from kvtier.kernels import EngineKV, gather, scatter, vllm_sources

    kv = EngineKV(layout, vllm_sources(layout, kv_caches))      # once, when the engine allocates its KV
    gather(kv, block_ids, packed)      # packed[i] <- engine block block_ids[i], every layer and part
    scatter(kv, block_ids, packed)     # engine block block_ids[i] <- packed[i]

``packed`` is an (N, layout.nbytes) uint8 tensor in host, pinned host or device memory. One call is one
kernel launch for all layers x blocks (cuda, triton) or one native call (cpu); the backend is chosen
automatically (cuda > triton > torch for GPU KV, cpu > torch for host KV) or forced with ``backend=``.
GPU copies are asynchronous on the current stream; CPU copies are done when the call returns.
"""

from kvtier.kernels.dispatch import (
    BACKENDS,
    SKIP,
    BackendUnavailable,
    KernelError,
    backend_status,
    gather,
    pick_backend,
    scatter,
)
from kvtier.kernels.enginekv import EngineKV, KVSource
from kvtier.kernels.engines import (
    flashinfer_sources,
    mla_sources,
    sglang_mla_sources,
    sglang_sources,
    vllm_legacy_sources,
    vllm_sources,
)

__all__ = [
    "BACKENDS", "SKIP", "BackendUnavailable", "EngineKV", "KVSource", "KernelError", "backend_status",
    "flashinfer_sources", "gather", "mla_sources", "pick_backend", "scatter", "sglang_mla_sources",
    "sglang_sources", "vllm_legacy_sources", "vllm_sources",
]
