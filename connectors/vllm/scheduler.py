"""SchedulerSide: the scheduler-role half of KVTierConnector (vLLM's engine-core process, scheduler thread).

Decides, per request, which blocks to load and which to save; moves no bytes and never waits:

* ``get_num_new_matched_tokens``: the first call sends a lookup of the request's block hashes (from the end
  of its local prefix-cache hit) to every worker and answers None ("ask again"); a later call reads the
  answer: the blocks every rank holds, pinned for us until the load. A lookup nobody answers within
  ``lookup_timeout_s`` is a miss. vLLM needs to compute at least the prompt's last token, so a hit stops
  one token short of the prompt.
* ``update_state_after_alloc`` turns the hit into a load plan onto the blocks vLLM allocated;
  ``build_connector_meta`` hands the step's loads, its saves (full blocks this step completes, never the
  blocks that came from the store or the local prefix cache) and the leases to release to the workers.
* ``request_finished`` keeps a request's blocks while its saves or its asynchronous load may still read or
  write them; the workers report them in ``get_finished`` and vLLM frees them then.
* what it sees of each request (its block hashes when admitted, its stop reason and output blocks when it
  finishes, the client's hints) goes to every worker's store in the step's metadata (observe.py), so every
  rank's eviction policy learns the same agents; so does its standard hint envelope (``Request.kv_hints``,
  hints.py), which each worker applies to its store.

A lookup channel other than the embedded workers' (a shared pool the scheduler can ask directly) only needs
another object with LookupClient's ``submit / poll / result / expired / forget``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .compat import boundary_state_offloads, request_shared_prefix_boundary, resumed_req_ids
from .groups import FULL, MAMBA, GroupSpec, hit_boundaries, is_hybrid, save_mask
from .lookup import ConnectorLookup
from .hints import AgentHints, KvHintsNote, kv_hints_note, pin_of, request_hints
from .metadata import KVTierMetadata, LoadPlan, SavePlan
from .observe import Notebook
from .settings import ConnectorSettings

log = logging.getLogger(__name__)

NULL_BLOCK = 0  # vLLM's null block id: a position the group holds nothing for (outside its window)


class Lookups(Protocol):
    """How the scheduler asks where blocks are (lookup.LookupClient for the embedded workers)."""

    def submit(self, lease: int, hashes: Sequence[bytes], ttl_s: float) -> None: ...

    def poll(self) -> None: ...

    def result(self, lease: int) -> ConnectorLookup | None: ...

    def expired(self, lease: int) -> bool: ...

    def forget(self, lease: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class _Lookup:
    lease: int
    start: int  # first block looked up (the local prefix-cache hit ends there)
    stop: int  # one past the last block looked up
    result: ConnectorLookup | None = None
    answered: float = 0.0  # when the result came (its pins last lease_ttl_s from the lookup)


@dataclass
class _Tracked:
    """A request the scheduler admitted: its block tables (one per KV cache group) and how far each group's
    blocks are stored."""

    request: Any
    tables: list[list[int]] = field(default_factory=list)  # by group
    stored: list[int] = field(default_factory=list)  # by group: blocks [0, stored) stored, queued or passed over
    saves_sent: bool = False
    hints: AgentHints | None = None
    arrival_blocks: int = 0  # full blocks the request had when admitted (its output's come after)


class SchedulerSide:
    """See the module docstring. ``block_size``: vLLM's scheduler block size; ``hash_block_size``: the
    tokens per entry of ``request.block_hashes`` (a block's key is the hash that ends it)."""

    def __init__(self, settings: ConnectorSettings, lookups: Lookups, block_size: int,
                 hash_block_size: int | None = None, *, load: bool = True, save: bool = True,
                 groups: Sequence[GroupSpec] | None = None, retention_interval: int | None = 0) -> None:
        self.settings = settings
        # The KV cache groups (groups.py); a single full-attention group unless vLLM's config says otherwise.
        self.groups = tuple(groups) if groups else (GroupSpec(0, FULL, block_size, ()),)
        self.hybrid = is_hybrid(self.groups)
        self._by_index = {g.index: g for g in self.groups}
        # A recurrent state must be in place before the forward reads it, and vLLM waits for layer loads in
        # attention layers only: a model with such state loads between steps.
        self.load_async = settings.load_async or any(g.kind == MAMBA for g in self.groups)
        self.retention_interval = retention_interval  # vLLM's prefix_cache_retention_interval
        self.load = load  # kv_role kv_consumer or kv_both: look up and load prefixes
        self.save = save  # kv_role kv_producer or kv_both: store computed blocks
        self.lookups = lookups
        self.block_size = block_size
        hash_block_size = hash_block_size or block_size
        if block_size % hash_block_size:
            raise ValueError(f"block size {block_size} is not a multiple of the hash block size {hash_block_size}")
        self._hashes_per_block = block_size // hash_block_size
        self._next_lease = 1
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, LoadPlan] = {}  # planned, not sent yet
        self._loading: set[str] = set()  # asynchronous loads sent, not reported done
        self._releases: list[int] = []
        self._hit_tiers: dict[str, ConnectorLookup] = {}
        self.notes = Notebook()  # what the workers' stores are told at the next step
        self._kv_hints: list[KvHintsNote] = []  # standard envelopes, sent at the next step
        self.counters: dict[str, float] = {"lookups": 0, "lookup_hit_blocks": 0, "lookup_seconds": 0.0,
                                           "lookup_timeouts": 0}

    # ---- lookups -----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.load:
            return 0, False
        req_id = request.request_id
        start = num_computed_tokens // self.block_size
        # The prompt's last token is always computed: vLLM samples from its logits.
        stop = min(self.num_hashed_blocks(request), (request.num_tokens - 1) // self.block_size)
        lk = self._lookups.get(req_id)
        if lk is not None and ((lk.start, lk.stop) != (start, stop) or (
                lk.result is not None and time.monotonic() - lk.answered > self.settings.lease_ttl_s / 2)):
            # The local hit changed since, or the request waited for memory so long that its pins are
            # about to expire: look up again.
            self._drop_lookup(req_id)
            lk = None
        if stop <= start:
            return 0, False
        if lk is None:
            lk = self._lookups[req_id] = _Lookup(self._lease(), start, stop)
            self.lookups.submit(lk.lease, self.block_hashes(request, start, stop), self.settings.lease_ttl_s)
            self.counters["lookups"] += 1
            return None, False
        if lk.result is None:
            self.lookups.poll()
            lk.result = self.lookups.result(lk.lease)
            if lk.result is None:
                if not self.lookups.expired(lk.lease):
                    return None, False
                log.warning("kvtier: lookup for request %s unanswered after %.1f s; scheduling it without a "
                            "load", req_id, self.settings.lookup_timeout_s)
                self.counters["lookup_timeouts"] += 1
                self._drop_lookup(req_id)
                return 0, False
            self.lookups.forget(lk.lease)
            lk.answered = time.monotonic()
            self.counters["lookup_seconds"] += lk.result.seconds
            self.counters["lookup_hit_blocks"] += lk.result.length
        if lk.result.length == 0:
            return 0, False
        if self.hybrid and lk.start + lk.result.length > stop:
            return 0, False  # not possible: the ranks were asked about [start, stop) only
        self._hit_tiers[req_id] = lk.result
        return lk.result.length * self.block_size, self.load_async

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
                                 ) -> None:
        """``block_ids``: the request's whole block table of every KV cache group after this allocation."""
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            hints = request_hints(request)  # read once: the pin, the policy's notes, the envelope's note
            tracked = self._tracked[req_id] = _Tracked(request, stored=[0] * len(self.groups),
                                                       hints=pin_of(request, hints))
            tracked.arrival_blocks = self.num_hashed_blocks(request)
            arrival = self.block_hashes(request, 0, tracked.arrival_blocks)
            self.notes.arrived(request, arrival, hints,
                               self._checkpoints(request, tracked.arrival_blocks, num_external_tokens))
            note = kv_hints_note(request, tuple(arrival), hints)
            if note is not None:
                self._kv_hints.append(note)
        tracked.tables = [list(t) for t in block_ids]
        lk = self._lookups.pop(req_id, None)
        if lk is None:
            return
        count = num_external_tokens // self.block_size
        if count <= 0 or lk.result is None:
            self._release(lk)
            return
        count = min(count, lk.result.length)
        if self.hybrid and not lk.result.reply.boundaries()[count - 1]:
            log.error("kvtier: request %s: vLLM took %d blocks, a boundary no rank can restore; not loading",
                      req_id, count)
            self._release(lk)
            return
        end = lk.start + count
        if any(end > len(tracked.tables[g.index]) for g in self.groups):
            log.error("kvtier: request %s has %s blocks, the load needs %d; not loading", req_id,
                      [len(t) for t in tracked.tables], end)
            self._release(lk)
            return
        hashes, ids, groups = [], [], []
        for group in self.groups:
            table = tracked.tables[group.index]
            for i in group.needed(lk.start, end):
                if table[i] == NULL_BLOCK:
                    if group.kind == MAMBA:  # KV without its state would be a wrong answer: no load at all
                        log.error("kvtier: request %s: vLLM allocated no block for group %d's state at block %d; "
                                  "not loading", req_id, group.index, i)
                        self._release(lk)
                        return
                    continue  # vLLM holds no block there (outside the group's window): nothing to load
                hashes += self.block_hashes(request, i, i + 1)
                ids.append(table[i])
                groups.append(group.index)
        self._loads[req_id] = LoadPlan(req_id, lk.lease, tuple(hashes), tuple(ids),
                                       layerwise=not self.load_async,
                                       groups=tuple(groups) if self.hybrid else ())
        tracked.stored = [max(s, end) for s in tracked.stored]

    # ---- the step's metadata -----------------------------------------------------------------------------

    def build_connector_meta(self, so: Any) -> KVTierMetadata:
        meta = KVTierMetadata(loads=list(self._loads.values()), releases=self._releases,
                              preempted=set(so.preempted_req_ids or ()), notes=self.notes.take(),
                              kv_hints=self._kv_hints)
        self._releases, self._kv_hints = [], []
        self._loading.update(p.req_id for p in meta.loads if not p.layerwise)
        self._loads.clear()
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.tables = [list(t) for t in new.block_ids]
            # Blocks the step starts from came from the local prefix cache or the store: not saved again.
            tracked.stored = [max(s, new.num_computed_tokens // self.block_size) for s in tracked.stored]
            self._plan_save(tracked, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id], meta)
        self._plan_state_saves(so, meta)
        cached = so.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    tracked.tables = [list(t) for t in new_ids]
                else:
                    for table, ids in zip(tracked.tables, new_ids):
                        table.extend(ids)
            self._plan_save(tracked, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id], meta)
        return meta

    def _checkpoints(self, request: Any, blocks: int, num_external_tokens: int) -> tuple[int, ...]:
        """A hybrid model's checkpoints (block boundaries) ``request`` restores from or makes, for the workers'
        eviction policies (observe.py): the boundary its hit restores (the engine's own prefix cache and
        kvtier's) and those its prefill checkpoints at (``hit_boundaries``, as its saves). Empty for a model of
        one group, whose blocks are all chain blocks."""
        if not self.hybrid:
            return ()
        lk = self._lookups.get(request.request_id)
        restored = (lk.start + num_external_tokens // self.block_size) if lk is not None else 0
        made = hit_boundaries(request.num_prompt_tokens, request_shared_prefix_boundary(request),
                              request.num_prompt_tokens, self.block_size, self.retention_interval)
        points = {restored, *(p // self.block_size for p in made)}
        return tuple(sorted(b for b in points if 0 < b <= blocks))

    def _plan_save(self, tracked: _Tracked, computed_tokens: int, meta: KVTierMetadata) -> None:
        if not self.save:
            return
        request = tracked.request
        if not self.settings.save_decode:
            computed_tokens = min(computed_tokens, request.num_prompt_tokens)
        boundaries = hit_boundaries(request.num_prompt_tokens, request_shared_prefix_boundary(request), request.num_tokens,
                                    self.block_size, self.retention_interval) if self.hybrid else ()
        for gi, group in enumerate(self.groups):
            table = tracked.tables[group.index]
            # Only full blocks whose hash exists (speculative tokens have none yet) and that are allocated.
            full = min(computed_tokens // self.block_size, self.num_hashed_blocks(request), len(table))
            start = tracked.stored[gi]
            if full <= start:
                continue
            tracked.stored[gi] = full
            # Only blocks a later hit can use (groups.save_mask), and never vLLM's null block.
            keep = [start + i for i, use in enumerate(save_mask(group, start, full, boundaries, self.hybrid))
                    if use and table[start + i] != NULL_BLOCK]
            if not keep:
                continue
            hashes = self.block_hashes(request, start, full)
            meta.saves.append(SavePlan(request.request_id, tuple(hashes[i - start] for i in keep),
                                       tuple(table[i] for i in keep), tracked.hints, group=group.index))
            tracked.saves_sent = True

    def _plan_state_saves(self, so: Any, meta: KVTierMetadata) -> None:
        """Save the recurrent-state checkpoints vLLM wrote this step (Mamba "align" mode), each under the hash of
        the block that ends at its boundary. vLLM frees such a block a step or two later whatever we do, so the
        save reads it before the step ends (``sync``)."""
        if not self.save:
            return
        for req_id, entries in boundary_state_offloads(so).items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            for group_id, block_id, boundary in entries:
                group = self._by_index.get(group_id)
                if group is None or group.kind != MAMBA or block_id == NULL_BLOCK or boundary % self.block_size:
                    continue
                block = boundary // self.block_size - 1
                if not 0 <= block < self.num_hashed_blocks(request):
                    continue
                meta.saves.append(SavePlan(req_id, tuple(self.block_hashes(request, block, block + 1)), (block_id,),
                                           tracked.hints, group=group_id, sync=True))
                tracked.saves_sent = True

    # ---- completion ----------------------------------------------------------------------------------------

    def request_finished(self, request: Any) -> bool:
        """True if vLLM must keep the request's blocks until a worker reports it in get_finished."""
        req_id = request.request_id
        self._drop_lookup(req_id)
        self._hit_tiers.pop(req_id, None)
        plan = self._loads.pop(req_id, None)
        if plan is not None:  # planned but never sent: nothing touches the blocks
            self._releases.append(plan.lease)
        tracked = self._tracked.pop(req_id, None)
        if tracked is not None:
            self.notes.finished(request, self.block_hashes(request, tracked.arrival_blocks,
                                                           self.num_hashed_blocks(request)))
        if req_id in self._loading:
            return True  # the load is writing into the blocks; its finished_recving frees them
        return tracked is not None and tracked.saves_sent

    def on_worker_output(self, finished_recving: Iterable[str] | None, invalid_block_ids: Iterable[int] | None
                         ) -> None:
        for req_id in finished_recving or ():
            self._loading.discard(req_id)
        invalid = set(invalid_block_ids or ())
        if invalid:  # those blocks are recomputed by vLLM: save them again when they are
            for tracked in self._tracked.values():
                for gi, group in enumerate(self.groups):
                    for i, block in enumerate(tracked.tables[group.index][: tracked.stored[gi]]):
                        if block in invalid and block != NULL_BLOCK:
                            tracked.stored[gi] = i
                            break

    def hit_blocks_by_tier(self, request: Any) -> dict[str, int]:
        """Where the blocks of the request's last hit were, by tier name (for vLLM's hit-source stats)."""
        result = self._hit_tiers.pop(request.request_id, None)
        if result is None:
            return {}
        out: dict[str, int] = {}
        for name, _ in result.reply.tiers:
            out[name] = result.reply.count(name)
        return out

    def take_counters(self) -> dict[str, float]:
        out = dict(self.counters)
        for k in self.counters:
            self.counters[k] = 0
        return out

    def num_hashed_blocks(self, request: Any) -> int:
        return len(request.block_hashes) // self._hashes_per_block

    def block_hashes(self, request: Any, start: int, stop: int) -> list[bytes]:
        """The engine hashes of scheduler blocks [start, stop): for each, the hash that ends it. Only that
        range is copied (a decode step of a 128K-token request touches one block, not 8,000)."""
        k = self._hashes_per_block
        hashes = request.block_hashes
        return list(hashes[start:stop]) if k == 1 else list(hashes[(start + 1) * k - 1 : stop * k : k])

    # ---- internals -----------------------------------------------------------------------------------------

    def _lease(self) -> int:
        lease, self._next_lease = self._next_lease, self._next_lease + 1
        return lease

    def _drop_lookup(self, req_id: str) -> None:
        lk = self._lookups.pop(req_id, None)
        if lk is not None:
            self._release(lk)

    def _release(self, lk: _Lookup) -> None:
        self.lookups.forget(lk.lease)
        self._releases.append(lk.lease)
