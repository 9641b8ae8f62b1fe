"""A vLLM engine (0.32 or 0.33) without a model, for connector tests: the real Scheduler, the real KV cache config and
KV tensors (vLLM's own planner and allocator, on the CPU), real Requests with real block hashes, and the
worker-role connectors driven exactly as vLLM's model runner drives them (bind, start_load_kv,
wait_for_layer_load per layer, wait_for_save, get_transfer_results, get_block_ids_with_load_errors, the
KVOutputAggregator across ranks). Only the forward is fake: it writes, for every scheduled token, KV that is
a pure function of (rank, layer, position, token), so any block a load brings back can be checked
bit-exactly against what the forward would have computed.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvtier.connectors.vllm.compat import VLLM_VERSION, plan_kv_cache_configs  # noqa: E402

BLOCK = 16
LAYERS = 3
HEADS = 2  # per rank
HEAD_SIZE = 16
EOS = 2
PREFIX = list(range(100, 100 + 5 * BLOCK))  # five full blocks shared by the tests' requests A and B


def tiny_model(directory: Path) -> str:
    """A Llama config vLLM can inspect without weights or a tokenizer (no network)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "head_dim": HEAD_SIZE, "rms_norm_eps": 1e-5, "eos_token_id": EOS}))
    return str(directory)


def vllm_config(model: str, extra: dict[str, Any], *, tp: int = 1, events: bool = False,
                failure_policy: str = "recompute", kv_layout: str = "LBNHC", kv_role: str = "kv_both") -> VllmConfig:
    """``kv_layout``: the physical KV cache layout the engine core would resolve (layer-outer LBNHC is the
    default; block-outer BLNHC makes layers share each block's page)."""
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=512),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm", kv_role=kv_role,
            kv_connector_extra_config=extra, kv_load_failure_policy=failure_policy),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.kv_cache_layout = kv_layout  # resolved by the engine core before connectors exist
    return config


def make_request(req_id: str, tokens: list[int], max_tokens: int = 2, **params: Any) -> Request:
    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(req_id, tokens, sampling, None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    if params:
        req.kv_transfer_params = params
    return req


@functools.lru_cache(maxsize=1 << 16)
def expected_kv(rank: int, layer: int, position: int, token: int) -> torch.Tensor:
    """What the fake forward writes for one token of one layer: (heads, 2 * head_size) float16."""
    g = torch.Generator().manual_seed(((rank * 131 + layer) * 1_000_003 + position) * 50_021 + token)
    return torch.randn(HEADS, 2 * HEAD_SIZE, generator=g).to(torch.float16)


@functools.lru_cache(maxsize=1 << 12)
def expected_state(rank: int, layer: int, tokens: tuple[int, ...]) -> torch.Tensor:
    """What the fake forward leaves as a recurrent (Mamba) layer's state after ``tokens``: page bytes (int8) that
    depend on every token before, so a state of another position or another prefix never matches."""
    g = torch.Generator().manual_seed((rank * 131 + layer) * 1_000_003 + hash(tokens) % 1_000_000_007)
    return torch.randint(-128, 128, (MAMBA_STATE_BYTES,), generator=g, dtype=torch.int8)


MAMBA_STATE_BYTES = 512  # the state bytes the fake forward writes at the start of a Mamba layer's page


class Engine:
    """Scheduler + ``tp`` worker connectors over CPU KV tensors. ``step()`` runs one engine step."""

    def __init__(self, config: VllmConfig, tp: int = 1, num_blocks: int = 64,
                 specs: dict[str, Any] | None = None) -> None:
        """``specs``: layer name -> KVCacheSpec (default: LAYERS full-attention layers); more than one kind
        of spec makes a hybrid model, planned into several KV cache groups by vLLM's hybrid manager."""
        self.config = config
        if specs is None:
            specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
                for i in range(LAYERS)}
        else:
            config.scheduler_config.disable_hybrid_kv_cache_manager = False  # the CPU platform says no
        page = next(iter(specs.values())).page_size_bytes * len(specs)
        config.cache_config.num_gpu_blocks_override = num_blocks
        configs = plan_kv_cache_configs(config, [specs] * tp, [page * num_blocks] * tp)
        for c in configs:
            c.kv_cache_layout = config.cache_config.kv_cache_layout
        sched_config = generate_scheduler_kv_cache_config(configs)
        config.cache_config.num_gpu_blocks = sched_config.num_blocks
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=sched_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
        self.layer_names = list(specs)
        # layer -> its KV cache group, and that group's sliding window (0: full attention)
        self.group_of = {n: g for g, group in enumerate(sched_config.kv_cache_groups) for n in group.layer_names}
        self.window_of = {n: int(getattr(specs[n], "sliding_window", None) or 0) for n in specs}
        self.mamba = {n for n in specs if isinstance(specs[n], MambaSpec)}
        self.states_checked = 0  # Mamba states the forward resumed from and found right
        self.workers = []
        self.kv: list[dict[str, torch.Tensor]] = []
        layout = config.cache_config.get_resolved_kv_cache_layout()
        for rank in range(tp):
            rank_config = copy.copy(config)
            rank_config.parallel_config = copy.copy(config.parallel_config)
            rank_config.parallel_config.rank = rank
            worker = KVConnectorFactory.create_connector(rank_config, KVConnectorRole.WORKER, configs[rank])
            kv = allocate_kv_cache(configs[rank], torch.device("cpu"), layout)
            for t in kv.values():
                # stale garbage: a block nobody wrote or loaded never looks right by chance
                t.normal_() if t.is_floating_point() else t.random_(-128, 128)
            worker.register_kv_caches(kv)
            self.workers.append(worker)
            self.kv.append(kv)
        self.aggregator = KVOutputAggregator(tp)
        self.events: list[Any] = []  # every KV event batch the scheduler published, flattened
        self.scheduler.kv_event_publisher.publish = lambda batch: self.events.extend(batch.events)  # type: ignore
        self.load_errors: set[int] = set()
        self.stats: Any = None  # every worker's connector stats, summed over all steps
        self.verified_tokens = 0
        self.closed = False

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> Any:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        outputs = []
        for rank, worker in enumerate(self.workers):
            if so.preempted_req_ids:
                worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                worker.start_load_kv(None)
            self._forward(rank, worker, so)
            if not so.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(so.finished_req_ids)
            errors = worker.get_block_ids_with_load_errors()
            self.load_errors |= errors
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                self.stats = stats if self.stats is None else self.stats.aggregate(stats)
            kv_out = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                       finished_recving=results.finished_recving or None,
                                       invalid_block_ids=errors, kv_connector_stats=stats,
                                       kv_cache_events=worker.get_kv_connector_kv_cache_events())
            worker.clear_connector_metadata()
            outputs.append(self._model_output(so, kv_out))
        output = self.aggregator.aggregate(outputs)
        self.scheduler.update_from_output(so, output)
        self.verify()
        if not so.total_num_scheduled_tokens:
            time.sleep(0.002)  # an idle step (a lookup or a load in flight): let the connector's threads run
        return so

    def run(self, until: Iterable[Request], max_steps: int = 200) -> int:
        """Step until every request in ``until`` finished; return the number of steps."""
        reqs = list(until)
        for n in range(1, max_steps + 1):
            self.step()
            if all(r.is_finished() for r in reqs) and not self.scheduler.requests:
                return n
        raise AssertionError(f"requests not finished after {max_steps} steps: "
                             f"{[(r.request_id, r.status) for r in reqs]}")

    def wait_idle_transfers(self, steps: int = 50) -> None:
        """Step an idle engine until the workers' saves are all reported done."""
        for _ in range(steps):
            if not self.scheduler.requests:
                return
            self.step()

    def verify(self) -> None:
        """Every computed token of every running request holds exactly what the forward writes (a
        sliding-window layer: every token inside the window of the next one)."""
        for req in self.scheduler.running:
            tables = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
            tokens = req.all_token_ids
            for rank, kv in enumerate(self.kv):
                for layer, name in enumerate(self.layer_names):
                    if name in self.mamba:
                        continue  # checked where the forward resumes from it (_forward_state)
                    ids, window = tables[self.group_of[name]], self.window_of[name]
                    first = max(0, req.num_computed_tokens - window + 1) if window else 0
                    for p in range(first, req.num_computed_tokens):
                        got = kv[name][ids[p // BLOCK], :, p % BLOCK, :]
                        if not torch.equal(got, expected_kv(rank, layer, p, tokens[p])):
                            raise AssertionError(f"request {req.request_id} rank {rank} layer {layer} token {p}: "
                                                 "KV differs from what the forward computed")
                        self.verified_tokens += 1

    def _work(self, so: Any) -> list[tuple[str, tuple[list[int], ...], int]]:
        """(request, its block tables by group, tokens computed before this step) for every scheduled request."""
        work = [(new.req_id, new.block_ids, new.num_computed_tokens) for new in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        work += [(req_id, self.scheduler.kv_cache_manager.get_block_ids(req_id), cached.num_computed_tokens[i])
                 for i, req_id in enumerate(cached.req_ids)]
        return work

    def _forward(self, rank: int, worker: Any, so: Any) -> None:
        work = self._work(so)
        kv = self.kv[rank]
        for layer, name in enumerate(self.layer_names):
            worker.wait_for_layer_load(name)
            if name in self.mamba:
                for req_id, tables, start in work:
                    self._forward_state(rank, layer, name, req_id, tables[self.group_of[name]], start,
                                        so.num_scheduled_tokens[req_id])
                continue
            for req_id, tables, start in work:
                block_ids = tables[self.group_of[name]]
                tokens = self.scheduler.requests[req_id].all_token_ids
                for p in range(start, start + so.num_scheduled_tokens[req_id]):
                    kv[name][block_ids[p // BLOCK], :, p % BLOCK, :] = expected_kv(rank, layer, p, tokens[p])
            worker.save_kv_layer(name, kv[name], None)

    def _forward_state(self, rank: int, layer: int, name: str, req_id: str, table: list[int], start: int,
                       count: int) -> None:
        """A recurrent layer (vLLM's Mamba "align" mode, as the harness models it): a step that starts at a block
        boundary resumes from the state in the block ending there, which must be the state of exactly the
        tokens before it (else the step fails, like verify); it leaves the state after each boundary it
        crosses in the block ending there."""
        tokens = self.scheduler.requests[req_id].all_token_ids
        page = self.kv[rank][name]
        if start and start % BLOCK == 0 and table[start // BLOCK - 1] != 0:
            got = page[table[start // BLOCK - 1]].flatten()[:MAMBA_STATE_BYTES]
            if not torch.equal(got, expected_state(rank, layer, tuple(tokens[:start]))):
                raise AssertionError(f"request {req_id} rank {rank} layer {layer}: the state it resumes from at "
                                     f"token {start} is not the state of its first {start} tokens")
            self.states_checked += 1
        for boundary in range((start // BLOCK + 1) * BLOCK, start + count + 1, BLOCK):
            block = table[boundary // BLOCK - 1]
            if block != 0:
                page[block].view(-1)[:MAMBA_STATE_BYTES] = expected_state(rank, layer, tuple(tokens[:boundary]))

    def _model_output(self, so: Any, kv_out: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        for req_id, _, start in self._work(so):
            req = self.scheduler.requests[req_id]
            done = start + so.num_scheduled_tokens[req_id] >= req.num_tokens
            req_ids.append(req_id)
            sampled.append([7 + len(req.all_token_ids) % 100] if done else [])
        if VLLM_VERSION >= (0, 34):  # 0.34 derives the index from req_ids
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_out)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.scheduler.connector.shutdown()
        for w in self.workers:
            w.shutdown()


# ---- what the connector tests share: helpers (the fixtures are tests/vllm_fixtures.py, a pytest plugin) ----


def save_a_then_drop_hbm(eng: Engine, **params) -> None:
    """Request A computes and saves the prefix; then HBM forgets it (as eviction would)."""
    a = make_request("A", PREFIX + [5, 6, 7], **params)
    eng.add(a)
    eng.run([a])
    assert eng.scheduler.reset_prefix_cache()


def worker_side(eng: Engine, rank: int = 0):
    return eng.workers[rank]._worker


def keys_of(eng: Engine, req, rank: int = 0) -> list[bytes]:
    return worker_side(eng, rank).namespace.keys(req.block_hashes)


__all__ = ["BLOCK", "PREFIX", "Engine", "RequestStatus", "engine", "expected_kv", "ipc_dir", "keys_of",
           "make_request", "model", "save_a_then_drop_hbm", "tiny_model", "vllm_config", "worker_side"]
