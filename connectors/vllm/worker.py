"""WorkerSide: the worker-role half of KVTierConnector (one per TP/PP rank, in that rank's process).

In embedded mode each worker owns the TieredStore holding its rank's blocks (DRAM, optional SSD): keys are
the engine's block hashes folded into this rank's namespace (model, layout, rank, world size, cache group),
so two ranks or two models never see each other's blocks. The worker:

* serves the scheduler's prefix lookups (lookup.py) and pins what it reports under the lookup's lease;
* runs the step's loads and saves on its copy threads (transfer.py): a load after the lookup that found
  it, a save after the forward that computed the blocks;
* tells vLLM which asynchronous loads finished (``get_finished`` recving), which requests' saves are done
  so their GPU blocks can be freed (sending), and which engine blocks failed to load (recomputed).

Engine-thread methods (``start_loads`` .. ``take_load_errors``) are called by vLLM's model runner on one thread;
job completions arrive on the copy threads and are handed over under a lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvtier.config import Config
from kvtier.connectors.kv_hints import HintOutcomes, apply_kv_hints
from kvtier.connectors.prefetching import WorkerPrefetch
from kvtier.connectors.rank_store import open_rank_store
from kvtier.keys.hashers import vllm_namespace
from kvtier.keys import Namespace
from kvtier.store.leases import LeaseTable
from kvtier.store import TieredStore

from .events import EventRecorder, event_group
from .groups import FULL, MAMBA, GroupSpec, is_hybrid, needed_blocks, restorable
from .lookup import LookupServer, RankLookupReply, endpoint
from .hints import KvHintsNote
from .metadata import KVTierMetadata
from .pagedkv import PagedKV
from .paths import PER_WORKER_KEYS, model_dir, per_worker, rank_dir
from .settings import ConnectorSettings
from .shutdown import close_timeout
from .transfer import LoadJob, SaveJob, Transfers, lookup_lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker is: what its keys are namespaced by, and where its lookup socket lives."""

    model: str
    rank: int
    world_size: int
    engine_id: str
    dp_rank: int = 0
    block_size: int = 16
    revision: str | None = None  # the model revision (part of the namespace)
    hash_algo: str = "sha256"  # vLLM's prefix_caching_hash_algo (part of the namespace)
    weights: str = ""  # the checkpoint's fingerprint (weights.py; part of the namespace); "": none could be read
    weights_source: str = ""  # what it was computed from (logged)
    # How ``rank`` (of ``world_size`` = tp x pcp x pp) splits, and the engine's DP size: they name the
    # worker's own directories (paths.py), not its keys.
    tp_size: int = 0  # 0: world_size (plain tensor parallelism)
    pcp_size: int = 1
    dp_size: int = 1

    @property
    def rank_dir(self) -> str:
        tp = self.tp_size or self.world_size
        return rank_dir(self.rank, tp=tp, pcp=self.pcp_size, pp=self.world_size // (tp * self.pcp_size),
                        dp_rank=self.dp_rank, dp_size=self.dp_size)


class WorkerSide:
    """See the module docstring. ``config``: the store's Config, loaded once by the connector (split_extra_config)."""

    def __init__(self, settings: ConnectorSettings, config: Config, identity: WorkerIdentity,
                 groups: Sequence[GroupSpec], *, events: bool = False) -> None:
        self.settings = settings
        self.identity = identity
        self.config = config
        self.groups = tuple(groups)
        self._events_enabled = events
        self.kv: PagedKV | None = None  # group 0's (the only group of a uniform model)
        self.kvs: list[PagedKV] = []  # by group, as in self.groups
        self.store: TieredStore | None = None
        self.namespace: Namespace | None = None  # group 0's
        self.namespaces: list[Namespace] = []  # by group: model, the group's layout, rank, group index
        self.recorder: EventRecorder | None = None
        self.prefetch: WorkerPrefetch | None = None  # where a tier sits below DRAM (connectors/prefetching.py)
        self._transfers: Transfers | None = None
        self._server: LookupServer | None = None
        self.lookup_leases: LeaseTable | None = None
        self._lock = threading.Lock()
        self._step_loads: list[LoadJob] = []  # layer-wise loads of the bound step
        self._loads_done: list[LoadJob] = []  # finished asynchronous loads, not yet reported
        self._load_parts: dict[tuple[str, int], list[LoadJob]] = {}  # a request's done jobs until its last
        self._load_errors: set[int] = set()
        # Requests that had a save job (vLLM keeps their blocks when they finish) -> their jobs not done yet.
        self._save_jobs: dict[str, list[SaveJob]] = {}
        self._awaiting_free: set[str] = set()  # finished requests whose blocks wait for their saves
        self._lookups_served = 0
        self.hint_outcomes = HintOutcomes()  # the standard envelopes' outcomes, counted in the stats (hint_*)
        self._deferred_pins: dict[str, KvHintsNote] = {}  # by request, until it finishes (its saves done)
        self._stalled_waits = 0  # load_timeout_s periods the engine thread waited on a copy thread

    # ---- set-up -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Build the packed-block map, this rank's store and namespace, the copy threads, the lookup server."""
        if self.kv is not None:
            raise RuntimeError("kvtier: register_kv_caches was called twice; the KV caches are already mapped")
        ident = self.identity
        hybrid = is_hybrid(self.groups)
        if hybrid:  # each group's own tensors (layers of different groups may share an allocation)
            self.kvs = [PagedKV(state_views(g, kv_caches), list(g.layer_names), 1, mla=True) if g.kind == MAMBA
                        else PagedKV({n: kv_caches[n] for n in g.layer_names if n in kv_caches}, list(g.layer_names),
                                     g.block_size, g.mla) for g in self.groups]
        else:
            self.kvs = [PagedKV(kv_caches, list(self.groups[0].layer_names), ident.block_size, self.groups[0].mla)]
        self.kv = self.kvs[0]
        sizes = {kv.layout.nbytes for kv in self.kvs}
        if len(sizes) > 1:
            raise ValueError(f"kvtier: the KV cache groups' blocks differ in size ({[kv.layout.nbytes for kv in self.kvs]}"
                             " bytes); kvtier's store holds one block size. Run this model without kvtier")
        config = self.config
        model = config.model or ident.model
        # A group's keys are its own: the group's layout and index (and, in a hybrid model, its kind) are in the
        # namespace, so a block of another group, shape or dtype is a miss, never bytes of the wrong layer.
        self.namespaces = [vllm_namespace(model, kv.layout.fingerprint, rank=ident.rank, world_size=ident.world_size,
                                          revision=ident.revision, hash_algo=ident.hash_algo, weights=ident.weights,
                                          cache_group=g.index, group_kind=g.kind if hybrid else "")
                           for g, kv in zip(self.groups, self.kvs)]
        self.namespace = self.namespaces[0]
        if not ident.weights:
            log.warning("kvtier worker %s: keys are not tied to the weights (%s): a checkpoint replaced under the "
                        "name %s would be served the old checkpoint's KV from the SSD or a pool; set "
                        "weights_fingerprint to an id of the checkpoint", ident.rank_dir, ident.weights_source or
                        "no fingerprint", model)
        # Every rank is its own process with its own store: paths a store owns get the rank's subdirectory.
        config = per_worker(config, model_dir(model, ident.revision), ident.rank_dir)
        self.store = open_rank_store(config, self.kv.layout, rank=ident.rank_dir, engine="vLLM",
                                     hint_max_fraction=self.settings.hint_max_fraction)
        # Lookup pins have their own table: the hint budget must never drop the pins of a load in flight.
        self.lookup_leases = LeaseTable(self.store)
        self.prefetch = WorkerPrefetch.for_store(self.store, self.settings.prefetch)
        if self._events_enabled:
            # Asked from eviction callbacks: local tiers only (in distributed mode, no master RPC per eviction).
            self.recorder = EventRecorder(ident.block_size, holds=partial(self.store.contains, local_only=True),
                                          groups={g.index: event_group(g) for g in self.groups})
            self.store.add_listener(self.recorder.on_store_event)
        self._transfers = Transfers(self.store, self.lookup_leases, self.kv, self.settings.staging_bytes,
                                    on_load_done=self._load_done, on_save_done=self._save_done,
                                    naming=self.recorder.naming if self.recorder is not None else None)
        address = endpoint(self.settings.socket_dir(), ident.engine_id, ident.dp_rank, ident.rank)
        self._server = LookupServer(address, self._lookup, on_idle=self._sweep)
        log.info("kvtier worker rank %d/%d (%s): %s; namespace %s (%s, weights %s from %s), store %s%s", ident.rank,
                 ident.world_size, ident.rank_dir, self.kv.describe(), self.namespace.digest.hex()[:12], model,
                 ident.weights or "none", ident.weights_source or "-",
                 [t.name for t in self.store.tiers],
                 "".join(f", {k} {getattr(config, k)}" for k in PER_WORKER_KEYS if getattr(config, k)))

    # ---- lookups (the lookup server's thread) --------------------------------------------------------------

    def _lookup(self, lease: int, hashes: list[bytes], ttl_s: float) -> RankLookupReply:
        if self.store is None or self.namespace is None:
            return RankLookupReply(0)
        if is_hybrid(self.groups):
            return self._lookup_groups(lease, hashes, ttl_s)
        keys = self.namespace.keys(hashes)
        # One pass: the prefix found is pinned under the lookup's lease until the load (or its expiry).
        hit = self.lookup_leases.lease_prefix(lookup_lease(lease), keys, ttl_s)
        if hit.length == 0:  # a repeated lookup of this lease that finds nothing now ends the lease
            self.lookup_leases.release(lookup_lease(lease))
        self._lookups_served += 1
        return RankLookupReply(hit.length, tuple(hit.runs))

    def _lookup_groups(self, lease: int, hashes: list[bytes], ttl_s: float) -> RankLookupReply:
        """A hybrid model's lookup: the boundaries at which every group holds what a hit there needs
        (groups.restorable), and those blocks pinned under the lease. A block evicted between the look and
        the pin makes the answer shrink (asked again), never a hit with a hole."""
        keys = [ns.keys(hashes) for ns in self.namespaces]
        name = lookup_lease(lease)
        present = [self.store.contains(k) for k in keys]  # type: ignore[union-attr]
        for _ in range(3):
            valid = restorable(self.groups, present)
            need = needed_blocks(self.groups, valid)
            lost = False
            for g, blocks in enumerate(need):
                order = sorted(blocks)
                held = self.lookup_leases.lease(name, [keys[g][i] for i in order], ttl_s) if order else []  # type: ignore[union-attr]
                for i, ok in zip(order, held):
                    if not ok:
                        present[g][i] = False
                        lost = True
            if not lost:
                break
        else:
            valid = [False] * len(hashes)
        length = max((k + 1 for k, v in enumerate(valid) if v), default=0)
        if length == 0:
            self.lookup_leases.release(name)  # type: ignore[union-attr]
        self._lookups_served += 1
        # Where the hit is, for vLLM's per-source stats: the tiers of the full-attention group's blocks (the
        # bulk of a hit's bytes; held and pinned, so this answer needs no pin of its own).
        full = next((g for g, group in enumerate(self.groups) if group.kind == FULL), 0)
        tiers = tuple(self.store.lookup_prefix(keys[full][:length]).runs) if length else ()  # type: ignore[union-attr]
        return RankLookupReply(length, tiers, valid=tuple(valid[:length]))

    # ---- one engine step (the model runner's thread) -------------------------------------------------------

    def start_loads(self, meta: KVTierMetadata) -> None:
        """Tell the store what the scheduler saw of requests, release the leases the scheduler gave up, then
        queue this step's loads (the notes go first: this step's saves must find their requests' chains)."""
        store, ns, transfers = self._ready()
        if meta.notes:
            meta.notes.apply(store, ns, self.checkpoint_keys if is_hybrid(self.groups) else None)
        for note in meta.kv_hints:  # after the arrivals: a Demote / Retain finds the request's agent
            applied = apply_kv_hints(note.envelope, store, note.session, ns.keys(note.hashes), request=note.req_id,
                                     prefetcher=self.prefetch.prefetcher if self.prefetch is not None else None)
            self.hint_outcomes.record(f"request {note.req_id}", applied)
            if any(a.action == "Pin" and a.outcome == "deferred" for a in applied):
                # A first turn: its blocks are not stored yet. Pin them once the request's saves are done.
                self._deferred_pins[note.req_id] = note
        for lease in meta.releases:
            self.lookup_leases.release(lookup_lease(lease))
        for plan in meta.loads:
            parts = plan.parts()
            for n, (group, hashes, block_ids) in enumerate(parts):
                job = LoadJob(plan.req_id, plan.lease, self.namespaces[group].keys(hashes), hashes,
                              np.asarray(block_ids, dtype=np.int64), plan.layerwise, self.kvs[group],
                              final=n == len(parts) - 1, group=group)
                if job.layerwise:
                    self._step_loads.append(job)
                transfers.submit_load(job)

    def checkpoint_keys(self, hashes: Sequence[bytes], boundary: int) -> list[bytes]:
        """The store keys of a hybrid model's checkpoint at block ``boundary`` of the chain ``hashes``: each
        sliding-window group's window tail and each Mamba group's state (the blocks a hit there needs beyond the
        full-attention chain, ``GroupSpec.needed``), in their groups' namespaces."""
        keys: list[bytes] = []
        for group, ns in zip(self.groups, self.namespaces):
            if group.kind != FULL:
                keys += ns.keys([hashes[i] for i in group.needed(0, boundary)])
        return keys

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until every layer-wise load of this step has written layer ``layer_name``."""
        if not self._step_loads or self.kv is None:
            return
        for job in self._step_loads:
            layer = job.kv.index_of.get(layer_name)
            if layer is None:
                continue  # not a layer of the job's group (or one whose KV kvtier moves at all)
            if not job.wait_layer(layer, self.settings.load_timeout_s):
                log.warning("kvtier: layer-wise load for request %s timed out at layer %s after %.1f s; its "
                            "blocks will be recomputed", job.req_id, layer_name, self.settings.load_timeout_s)

    def queue_saves(self, meta: KVTierMetadata) -> None:
        """After the forward: queue this step's saves (the copy threads run them; nothing waits here)."""
        _, ns, transfers = self._ready()
        for plan in meta.saves:
            hints = plan.hints if self.settings.hint_max_fraction > 0 else None
            job = SaveJob(plan.req_id, self.namespaces[plan.group].keys(plan.hashes), plan.hashes,
                          np.asarray(plan.block_ids, np.int64), self.kvs[plan.group], hints, group=plan.group)
            with self._lock:
                self._save_jobs.setdefault(plan.req_id, []).append(job)
            transfers.submit_save(job)
            if plan.sync:
                self._wait(job.gathered, plan.req_id, f"save of {len(job.keys)} state blocks vLLM is about to free")

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """vLLM frees a preempted request's blocks at once: wait until its saves stopped reading them."""
        for req_id in meta.preempted:
            with self._lock:
                jobs = list(self._save_jobs.get(req_id, ()))
            for job in jobs:
                self._wait(job.gathered, req_id, f"save of {len(job.keys)} blocks to stop reading the engine "
                                                 "blocks vLLM frees for the preemption")

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves are all done, asynchronous loads done since the last call)."""
        finished_req_ids = set(finished_req_ids)
        with self._lock:
            self._awaiting_free.update(r for r in finished_req_ids if r in self._save_jobs)
            sending = {r for r in self._awaiting_free if not self._save_jobs[r]}
            for r in sending:
                self._awaiting_free.discard(r)
                del self._save_jobs[r]
            unsaved = {r for r in finished_req_ids if r not in self._save_jobs}  # saves done, or none made
            done, self._loads_done = self._loads_done, []
            for job in done:
                self._load_errors.update(job.failed)
        recving = {job.req_id for job in done}
        self._retry_pins(sending | unsaved)
        return sending or None, recving or None

    def _retry_pins(self, finished: Iterable[str]) -> None:
        """Apply again the Pins that were deferred at the arrival of these finished requests (their outcome is
        counted again): whatever of the arrival's blocks the store holds now is leased."""
        for req_id in finished:
            note = self._deferred_pins.pop(req_id, None)
            if note is not None and self.store is not None and self.namespace is not None:
                self.hint_outcomes.record(f"request {req_id}", apply_kv_hints(
                    note.envelope, self.store, note.session, self.namespace.keys(note.hashes), request=req_id,
                    only="Pin"))

    def take_load_errors(self) -> set[int]:
        """Engine blocks that failed to load: this step's layer-wise loads (they end here, after the forward)
        and the asynchronous loads get_finished just reported."""
        for job in self._step_loads:
            if not job.done.wait(self.settings.load_timeout_s):
                job.cancel()  # a cancelled job stops at its next layer; all its blocks count as failed
                self._wait(job.done, job.req_id, f"cancelled layer-wise load of {len(job.keys)} blocks to stop "
                                                 "writing the engine's blocks")
        with self._lock:
            for job in self._step_loads:
                self._load_errors.update(job.failed)
            errors, self._load_errors = self._load_errors, set()
        self._step_loads = []
        return errors

    def take_counters(self) -> dict[str, float]:
        counters = self._transfers.take_counters() if self._transfers is not None else {}
        counters["lookups_served"], self._lookups_served = self._lookups_served, 0
        counters["stalled_waits"], self._stalled_waits = self._stalled_waits, 0
        counters.update(self.hint_outcomes.take())
        if self.prefetch is not None:
            counters.update(self.prefetch.take_counters())
        return counters

    def take_events(self) -> list[Any]:
        return self.recorder.take() if self.recorder is not None else []

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._transfers is not None:
            self._transfers.close()
        if self.prefetch is not None:  # its last copies end before the store closes
            self.prefetch.close()
        if self.store is not None:
            # DRAM's blocks go down to the SSD before vLLM's executor would kill this process (shutdown.py).
            self.store.close(timeout_s=close_timeout(self.store.close_timeout_s))

    def _wait(self, done: threading.Event, req_id: str, pending: str) -> None:
        """Wait for ``done`` with no deadline (vLLM must not reuse engine blocks a copy thread still reads or
        writes), but never silently: an error every load_timeout_s names the request and what is pending,
        and each period counts in the worker stats (``stalled_waits``)."""
        period = self.settings.load_timeout_s
        waited = 0.0
        while not done.wait(period):
            waited += period
            self._stalled_waits += 1
            log.error("kvtier: request %s: still waiting after %.1f s for the %s (the engine thread is blocked; "
                      "a copy thread is stuck or far behind)", req_id, waited, pending)

    def _sweep(self) -> None:
        """Release expired leases (the lookup server's idle hook, a few times a second)."""
        self.lookup_leases.sweep()
        self.store.leases.sweep()  # type: ignore[union-attr]

    # ---- copy-thread callbacks ---------------------------------------------------------------------------

    def _load_done(self, job: LoadJob) -> None:
        if job.failed:
            log.info("kvtier: %d of %d blocks of request %s were not loaded (gone since the lookup); vLLM "
                     "recomputes them", len(job.failed), len(job.keys), job.req_id)
        if not job.layerwise:
            with self._lock:
                # A request's load is one job per group, run in order on one thread: it is reported done
                # (vLLM then computes on the blocks) only with its last job.
                parts = self._load_parts.setdefault((job.req_id, job.lease), [])
                parts.append(job)
                if job.final:
                    self._loads_done += self._load_parts.pop((job.req_id, job.lease))

    def _save_done(self, job: SaveJob) -> None:
        with self._lock:
            jobs = self._save_jobs.get(job.req_id)
            if jobs is not None and job in jobs:
                jobs.remove(job)

    def _ready(self) -> tuple[TieredStore, Namespace, Transfers]:
        if self.store is None or self.namespace is None or self._transfers is None:
            raise RuntimeError("kvtier: the worker has no KV caches yet (vLLM calls register_kv_caches first)")
        return self.store, self.namespace, self._transfers


def state_views(group: GroupSpec, kv_caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Mamba group's layers as (num_blocks, 1, 1, page) int8 views, block b = that layer's whole state page
    (conv and SSM state, and the padding vLLM gives every group's page): the bytes a checkpoint is. Built from
    where vLLM placed each layer (``GroupSpec.state_pages``), over the allocation the layer's tensor views,
    whatever view of it vLLM registered (the whole buffer, or typed state views)."""
    out = {}
    for name, offset, stride, page in group.state_pages:
        t = kv_caches.get(name)
        if t is None:
            continue
        storage = t.untyped_storage()
        n = (storage.nbytes() - offset - page) // stride + 1
        if n <= 0 or page > stride:
            raise ValueError(f"kvtier: state layer {name!r} of KV cache group {group.index}: page {page} B at offset "
                             f"{offset} every {stride} B does not fit its {storage.nbytes()} B allocation")
        view = torch.empty(0, dtype=torch.int8, device=t.device)
        view.set_(storage, offset, (n, 1, 1, page), (stride, stride, stride, 1))
        out[name] = view
    if not out:
        raise ValueError(f"kvtier: vLLM registered none of KV cache group {group.index}'s state layers "
                         f"{list(group.layer_names)[:3]}")
    return out
