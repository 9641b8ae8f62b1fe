"""KVTierConnector: vLLM's KVConnectorBase_V1 (vLLM 0.32, 0.33 and 0.34, see compat.py), delegating to a scheduler
half and a worker half.

It declares ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with kvtier, and hands every KV cache
group's blocks to the connector. groups.py says which kinds of group kvtier stores (full attention, sliding
window), which blocks of each a hit needs and which are worth storing; any other kind, and draft-model groups,
are refused here at start-up with an error naming the group.

vLLM builds two kinds of instance from the same config, in different processes: one with role SCHEDULER
in the engine core (it plans; scheduler.py) and one with role WORKER per TP/PP rank (it copies and owns
the rank's store; worker.py). This class only reads vLLM's config, builds the half its role needs, and
forwards vLLM's calls to it; a call made on the wrong role is vLLM's bug and raises.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"dram_capacity": "64GiB"}}'
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .compat import engine_ranks  # first: an unsupported vLLM fails here, naming its version

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.settings.tiers import tier_specs

from .compat import prefix_cache_retention_interval
from .events import EventQuorum, KVTierKVEvents
from .groups import describe_groups
from .lookup import LookupClient, endpoint
from .metadata import KVTierMetadata
from .scheduler import SchedulerSide
from .settings import split_extra_config
from .stats import KVTierConnectorStats
from .weights import model_weights
from .worker import WorkerIdentity, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# vLLM's per-source prefix-cache stats by the source each tier declares (kvtier/settings/tiers.py: the pool is
# another node's DRAM in distributed mode, this host's DRAM in standalone mode).
HIT_SOURCE = {"host": CacheHitSource.HOST, "p2p": CacheHitSource.P2P, "disk": CacheHitSource.DISK,
              "external": CacheHitSource.EXTERNAL_UNSPECIFIED}


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps prefixes alive below HBM (host DRAM, a remote pool, SSD) across requests. A best-effort cache: a
    block that cannot be loaded is recomputed (set ``kv_load_failure_policy: recompute``).

    Per engine, one SCHEDULER instance in the engine-core process (called on the scheduler's thread only)
    and one WORKER instance per TP/PP rank in that rank's process (called on the model runner's thread; it
    copies on threads of its own). Neither is thread-safe for vLLM's calls, which vLLM never makes
    concurrently. Buffers: vLLM's KV tensors stay vLLM's; the worker reads a block after the forward that
    wrote it and until its save is done (vLLM keeps a finished request's blocks until then), and writes a
    block only between vLLM allocating it for a load and the load being reported done.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        settings, config = split_extra_config(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r: a block evicted between lookup and load fails its "
                        "request instead of being recomputed; set \"kv_load_failure_policy\": \"recompute\"",
                        transfer.kv_load_failure_policy)
        # Every group kvtier will store, or an error naming the one it cannot (before anything starts).
        groups = describe_groups(kv_cache_config, speculative=vllm_config.speculative_config is not None)
        parallel = engine_ranks(vllm_config.parallel_config)
        ranks = parallel.world_size
        engine_id = str(transfer.engine_id)
        dp_rank = parallel.dp_rank
        events = bool(vllm_config.kv_events_config and vllm_config.kv_events_config.enable_kv_cache_events)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._quorum: EventQuorum | None = None
        self._step_loaded = self._step_saved = False
        self._tier_source = {spec.name: HIT_SOURCE[spec.source(config)] for spec in tier_specs()}
        if role == KVConnectorRole.SCHEDULER:
            block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            client = LookupClient([endpoint(settings.socket_dir(), engine_id, dp_rank, r) for r in range(ranks)],
                                  settings.lookup_timeout_s)
            self._scheduler = SchedulerSide(settings, client, block_size, hash_block_size,
                                            load=transfer.is_kv_consumer, save=transfer.is_kv_producer, groups=groups,
                                            retention_interval=prefix_cache_retention_interval(vllm_config))
            self._quorum = EventQuorum(ranks) if events else None
        else:
            model = vllm_config.model_config
            weights = model_weights(vllm_config, settings.weights_fingerprint)  # folded into the namespace
            identity = WorkerIdentity(
                model=str(model.model), rank=parallel.rank % ranks, world_size=ranks, engine_id=engine_id,
                dp_rank=dp_rank, block_size=groups[0].block_size, revision=model.revision,
                weights=weights.value, weights_source=weights.source,
                hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
                tp_size=parallel.tp_size, pcp_size=parallel.pcp_size, dp_size=parallel.dp_size)
            self._worker = WorkerSide(settings, config, identity, groups, events=events)
        self._events: list[KVCacheEvent] = []

    # ---- vLLM's contract ---------------------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never a wrong answer

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33's sleep mode frees and remaps the KV caches; the worker's PagedKV holds their addresses
        # from register_kv_caches. vLLM refuses sleep mode with this connector instead of loading into freed
        # memory. (0.32 has no sleep mode and never calls this.)
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise loads wait inside the attention layers: a full CUDA graph would replay without the waits.
        return extra_config.get("load_mode") == "layerwise"

    # ---- scheduler role ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        blocks = self._sched().hit_blocks_by_tier(request)
        total = sum(blocks.values())
        if not total:
            return {self._cache_hit_source: num_external_tokens}
        out: dict[CacheHitSource, int] = {}
        for tier, n in blocks.items():
            source = self._tier_source.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + num_external_tokens * n // total
        first = next(iter(out))
        out[first] += num_external_tokens - sum(out.values())  # rounding: the counts must add up
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # With SupportsHMA vLLM calls only this (every group's blocks): the saves were planned step by step
        # from the scheduler output, so what to keep is the same question for one group or several.
        return self._sched().request_finished(request), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().on_worker_output(connector_output.finished_recving, connector_output.invalid_block_ids)
        events = connector_output.kv_cache_events
        if self._quorum is not None and events is not None:
            self._quorum.add(events.get_all_events())
            self._events += self._quorum.take()

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # ---- worker role ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_loaded = self._step_saved = False

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata):
            self._work().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self._step_loaded:
            self._step_loaded = True
            self._work().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are queued once per step, after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if not self._step_saved:
            self._step_saved = True
            self._work().queue_saves(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVTierKVEvents | None:
        worker = self._work()
        if worker.recorder is None:
            return None
        return KVTierKVEvents(worker.take_events())  # empty still counts this worker in vLLM's aggregation

    # ---- both roles ----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        half = self._scheduler if self._scheduler is not None else self._worker
        stats = KVTierConnectorStats()
        stats.add(half.take_counters())  # type: ignore[union-attr]
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.lookups.close()
        if self._worker is not None:
            self._worker.close()

    def worker_side(self) -> WorkerSide:
        """The worker half (this rank's store, lookups and copies): for tools and tests that inspect a running
        engine's store, e.g. through ``LLM.collective_rpc``. Raises on the scheduler-role instance."""
        return self._work()

    # ---- internals -----------------------------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvtier: a scheduler-side method was called on the worker-role connector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvtier: a worker-side method was called on the scheduler-role connector")
        return self._worker

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata):
            raise TypeError(f"kvtier: expected KVTierMetadata from the scheduler, got {type(meta).__name__}")
        return meta
