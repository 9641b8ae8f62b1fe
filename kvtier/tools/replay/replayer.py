"""Replayer: a Workload through an HBM prefix cache and a real TieredStore, on a virtual clock.

Per request, at its arrival: the longest prefix held in HBM is free; the store's ``lookup_prefix`` continues
that prefix below HBM (DRAM, and the remote pool or SSD once the store has them), and those blocks are read
with ``get``; the rest is computed and stored through the offload mode (``write-through``: the computed blocks
go to the store at once, as vLLM's offloading connector and LMCache do; ``write-back``: blocks go to the
store when HBM evicts them). Keys are handed to the store tail first, as to the HBM model, so policies evict
a prefix's tail before its root. Cache effects happen at arrival (as an engine registers a request's blocks
when it schedules it); the service model (service.py) then says when the request finishes.

agentic-cc: ``lanes`` lanes each replay one conversation tree at a time; a subagent runs concurrently inside
its parent's lane and the parent's next request waits for all subagents spawned with it; a finished lane takes
the next replay of the workload's seeded order. A timed trace (Mooncake) issues requests at their timestamps.

The store is the real one, built with small stand-in blocks (see sweep.py): its tiers hold exactly as many
blocks as the real capacities would, and its put/get/lookup/eviction/dedup code runs unchanged. Bytes moved
are reported in real block bytes.

A hybrid model (hybrid.py) storing only what can be used is served by hybrid_replay.HybridCache instead: its
hits are the deepest boundary every cache group can be restored at, and its store slots stand for the
full-history groups' bytes of one block.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvtier.keys import Namespace
from kvtier.policies import Arrival, Completion, Hint
from kvtier.tools.replay.hbm import HbmPrefixCache
from kvtier.tools.replay.hybrid import HybridModel
from kvtier.tools.replay.hybrid_replay import HybridCache
from kvtier.tools.replay.prefetch import ReplayPrefetch
from kvtier.tools.replay.service import Server, ServiceModel
from kvtier.tools.replay.traces import Step, TraceRequest
from kvtier.tools.replay.workload import Replay, Workload
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

OFFLOAD_MODES = ("write-through", "write-back")
HBM = "hbm"


@dataclass(frozen=True)
class ReplayConfig:
    """How traces are replayed (independent of the cache being measured).

    The store is told what an engine knows, as an agent harness and its server would tell it: each request's
    arrival (its full chain) and completion (the trace's stop reason). ``sessions``: arrivals carry the agent's
    session id (each conversation and each subagent its own); off, the store infers agents from the chains.
    ``hints``: the harness also says when an agent is finished (after its last request) and when it waits on
    subagents (after the request that spawned them). ``prefetch``: between turns the store brings idle agents'
    prefixes up into DRAM (kvtier/prefetch.py), at the lower tiers' bandwidth left by demand loads
    (replay/prefetch.py)."""

    lanes: int = 32
    think_cap_s: float = 60.0
    offload: str = "write-through"
    sessions: bool = False
    hints: bool = False
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if not self.think_cap_s >= 0:
            raise ValueError(f"think-time cap must be >= 0 s, got {self.think_cap_s}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")


class RequestRecord(NamedTuple):
    """One served request (kept only with ``record=True``): which agent run, when, and what it hit."""

    run: int  # agent run id; -1 for a timed trace
    parent: int  # the parent run's id, -1 for a root
    step: int  # index of the request among its agent's steps
    arrival: float
    first_token: float
    done: float
    hbm_blocks: int
    store_blocks: int
    computed_tokens: int


@dataclass
class ReplayResult:
    """What one replay measured. Token counts are input tokens; ``stream`` is every block access in order
    (global block ids), which the offline limits (opt.py) are computed from."""

    requests: int = 0
    input_tokens: int = 0
    lost_blocks: int = 0  # found by lookup_prefix but gone at get (counted as computed)
    computed_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)  # "hbm", then the store's tiers in order
    bytes_loaded: dict[str, int] = field(default_factory=dict)  # per store tier, real bytes read into HBM
    bytes_stored: dict[str, int] = field(default_factory=dict)  # per store tier, real bytes written to it
    # A hybrid model's (hybrid_replay.py): exact real bytes per cache group written to / read from the store,
    # and what storing every group of the same blocks whole would have written.
    group_bytes_stored: dict[str, int] = field(default_factory=dict)
    group_bytes_loaded: dict[str, int] = field(default_factory=dict)
    whole_bytes_stored: int = 0
    capacity_blocks: dict[str, int] = field(default_factory=dict)  # per tier, HBM included
    ttft_s: np.ndarray = field(default_factory=lambda: np.empty(0))
    prefetch: dict[str, int] = field(default_factory=dict)  # blocks prefetched, used, wasted, cancelled
    # per lower tier, with prefetch on: seconds its read channel was held by demand loads and by prefetches
    channel_s: dict[str, dict[str, float]] = field(default_factory=dict)
    virtual_s: float = 0.0
    prefill_busy_s: float = 0.0
    cpu_s: float = 0.0
    stream: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.input_tokens if self.input_tokens else 0.0

    @property
    def dram_share(self) -> float:
        """Of the hits below HBM, the share that was in the store's top tier (DRAM) when its request arrived
        (counted at the lookup, before the request's own loads)."""
        saved = self.store_saved_tokens
        top = next((t for t in self.hit_tokens if t != HBM), None)
        return self.hit_tokens[top] / saved if saved and top is not None else 0.0

    @property
    def tier_hit_rate(self) -> dict[str, float]:
        n = self.input_tokens or 1
        return {t: v / n for t, v in self.hit_tokens.items()}

    @property
    def store_saved_tokens(self) -> int:
        """Prefill tokens the store saved: hits below HBM, which an engine alone would have recomputed."""
        return sum(v for t, v in self.hit_tokens.items() if t != HBM)

    def ttft_percentile(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) if len(self.ttft_s) else 0.0


class _Run:
    """One agent (a conversation or a subagent) being replayed: its steps and where it is in them."""

    __slots__ = ("steps", "index", "parent", "pending", "replay", "keys", "ident")

    def __init__(self, steps: tuple[Step, ...], parent: _Run | None, replay: Replay, keys: list[bytes],
                 ident: int) -> None:
        self.steps, self.index, self.parent, self.pending = steps, 0, parent, 0
        self.replay, self.keys, self.ident = replay, keys, ident


_ADVANCE, _ARRIVE, _READY, _DONE = 0, 1, 2, 3


class VirtualClock:
    """The replay's clock, shared with the store's policies (``TieredStore.from_config(..., clock=...)``): the
    virtual time of the event being handled."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Replayer:
    """Runs one replay; single-threaded and synchronous. The caller owns ``store`` (and closes it)."""

    def __init__(
        self, workload: Workload, namespace: Namespace, store: TieredStore | None, hbm_blocks: int,
        real_block_bytes: int, service: ServiceModel, config: ReplayConfig,
        progress: Callable[[int], Any] | None = None, record: bool = False, clock: VirtualClock | None = None,
        hybrid: HybridModel | None = None,
    ) -> None:
        self.workload, self.ns, self.store = workload, namespace, store
        self.clock = clock or VirtualClock()
        self.hbm = HbmPrefixCache(hbm_blocks)
        self.real_block_bytes, self.service, self.config = real_block_bytes, service, config
        self.server = Server(service)
        self.progress, self.record = progress, record
        self.tiers = [t.name for t in store.tiers] if store is not None else []
        self._bandwidth = {t: service.bandwidth(t) for t in self.tiers}
        self._bt = workload.block_tokens
        max_blocks = max((len(r.blocks) for t in workload.traces for r in t.iter_requests()), default=0)
        self._rows = np.zeros((max(max_blocks, 1), store.block_bytes if store else 1), dtype=np.uint8)
        self._put_limit = store.capacity_blocks if store else 0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._runs = 0
        self._queue: deque[Replay] = deque()
        self._stream = np.empty(workload.block_accesses, dtype=np.int32)  # filled in arrival order
        self._streamed = 0
        self._ttft: list[float] = []
        self._unreported = 0
        self._last_done = 0.0
        self._requests = 0  # request ids, in arrival order
        self.result = ReplayResult(hit_tokens={HBM: 0, **{t: 0 for t in self.tiers}})
        self.hybrid: HybridCache | None = None
        if hybrid is not None:  # ``hbm_blocks``, the tiers and ``real_block_bytes`` count slots (hybrid_replay.py)
            if config.offload != "write-through":
                raise ValueError("a hybrid model replays write-through only (its checkpoints are stored as its "
                                 "prefill makes them)")
            self.hybrid = HybridCache(hybrid, self._bt, store, self.hbm, workload.unique_blocks, self._bandwidth,
                                      self.result)
        self.prefetch = (ReplayPrefetch(store, self._bandwidth, real_block_bytes, self.hbm)
                         if config.prefetch and store is not None and len(store.tiers) > 1 and hybrid is None else None)

    # ---- the event loop --------------------------------------------------------------------------------

    def run(self) -> ReplayResult:
        cpu0 = time.process_time()
        replays = self.workload.replays
        if self.workload.timed:
            replay = replays[0]
            keys = self.workload.keys(replay, self.ns)
            run = _Run(replay.trace.steps, None, replay, keys, -1)
            for i, req in enumerate(replay.trace.steps):
                self._push(req.delay, _ARRIVE, (run, req, i))  # type: ignore[union-attr]
        else:
            self._queue.extend(replays)
            for _ in range(min(self.config.lanes, len(self._queue))):
                self._start_next(0.0)
        now = 0.0
        events, pop, clock = self._events, heapq.heappop, self.clock
        prefetch = self.prefetch
        while events:
            now, _, kind, payload = pop(events)
            clock.now = now
            if prefetch is not None:  # what the lower tiers' free time moved up before this event
                prefetch.advance(now)
            if kind == _ARRIVE:
                self._arrive(now, *payload)
            elif kind == _READY:
                self._ready(now, *payload)
            elif kind == _DONE:
                self._done(now, *payload)
            else:
                self._advance(payload, now)
        return self._finish(now, time.process_time() - cpu0)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _start_next(self, now: float) -> None:
        if self._queue:
            replay = self._queue.popleft()
            run = self._new_run(replay.trace.steps, None, replay, self.workload.keys(replay, self.ns))
            self._advance(run, now)

    def _new_run(self, steps: tuple[Step, ...], parent: _Run | None, replay: Replay, keys: list[bytes]) -> _Run:
        self._runs += 1
        return _Run(steps, parent, replay, keys, self._runs)

    def _advance(self, run: _Run, now: float) -> None:
        """Start the run's next step at ``now``; a finished run releases its parent or its lane."""
        cap = self.config.think_cap_s
        while True:
            if run.index == len(run.steps):
                parent = run.parent
                if parent is None:
                    self._start_next(now)
                    return
                parent.pending -= 1
                if parent.pending:
                    return
                run = parent  # the last subagent of a group finished: the parent goes on
                continue
            step = run.steps[run.index]
            if isinstance(step, TraceRequest):
                self._push(now + min(step.delay, cap), _ARRIVE, (run, step, run.index))
                return
            run.index += 1
            if step.agents:
                run.pending = len(step.agents)
                for agent, delay in zip(step.agents, step.spawn_delays):
                    child = self._new_run(agent, run, run.replay, run.keys)
                    self._push(now + min(delay, cap), _ADVANCE, child)
                return

    # ---- one request ------------------------------------------------------------------------------------

    def _arrive(self, now: float, run: _Run, req: TraceRequest, step: int) -> None:
        ids = req.blocks
        n = len(ids)
        at = self._streamed
        np.add(ids, run.replay.id_offset, out=self._stream[at: at + n])
        self._streamed = at + n
        keys = list(map(run.keys.__getitem__, ids.tolist()))
        self._requests += 1
        rid = str(self._requests)
        store = self.store
        session = str(run.ident) if self.config.sessions and run.ident != -1 else None
        arrival = Arrival(rid, keys, now, session)
        if self.hybrid is not None:  # observed once its checkpoints are known: after its lookup, before its puts
            h, d, load_s = self.hybrid.serve(keys, self._stream[at: at + n], arrival)
        else:
            if store is not None:  # as an engine registers a request when it schedules it, before its lookup
                store.observe(arrivals=[arrival])
            h, d, load_s = self._serve(now, keys)
        res = self.result
        res.hit_tokens[HBM] += h * self._bt
        computed = req.input_tokens - (h + d) * self._bt
        res.computed_tokens += computed
        res.input_tokens += req.input_tokens
        res.requests += 1
        ready = self.server.load(now, load_s)
        payload = (run, req, step, now, computed, h, d, rid)
        if ready > now:
            self._push(ready, _READY, payload)
        else:
            self._ready(now, *payload)

    def _serve(self, now: float, keys: list[bytes]) -> tuple[int, int, float]:
        """(HBM blocks, store blocks, load seconds) of a uniform model's request: HBM's prefix, the store's
        continuation of it, the computed rest stored (write-through) or HBM's victims (write-back)."""
        h = self.hbm.prefix(keys)
        d = 0
        load_s = 0.0
        n, store = len(keys), self.store
        if store is not None and h < n:
            rest = keys[h:]
            found = store.lookup_prefix(rest)
            d = found.length
            if d:
                loaded = rest[:d]
                loaded.reverse()
                got = store.get(loaded, self._rows[:d])
                if not all(got):  # a block went between lookup and get (a tier writing behind): recompute
                    got.reverse()
                    d = got.index(False)
                    self.result.lost_blocks += len(got) - d
                per_tier = {tier: found.count(tier, d) for tier, _ in found.runs}
                bt, hit_tokens = self._bt, self.result.hit_tokens
                for tier, count in per_tier.items():
                    hit_tokens[tier] += count * bt
                    load_s += count * self.real_block_bytes / self._bandwidth[tier]
                if self.prefetch is not None:  # the demand load holds each tier's channel for its part
                    start = max(self.server.link_free, now)
                    for tier, count in per_tier.items():
                        self.prefetch.demand(tier, start, count * self.real_block_bytes / self._bandwidth[tier])
            if self.config.offload == "write-through" and h + d < n:
                self._put_tail_first(keys[h + d:])
        victims = self.hbm.admit(keys)
        if store is not None and victims and self.config.offload == "write-back":
            self._put_tail_first(victims[::-1])  # victims come tail first; give them root first
        return h, d, load_s

    def _put_tail_first(self, keys: list[bytes]) -> None:
        """Store ``keys`` (root first) tail first, in batches the top tier can hold: a batch larger than the
        tier would be cut short at its end, losing the roots; batch after batch, the tails move down a tier
        and the root-most blocks stay on top."""
        store, limit = self.store, self._put_limit
        for end in range(len(keys), 0, -limit):
            batch = keys[max(0, end - limit): end]
            batch.reverse()
            store.put(batch, self._rows[: len(batch)])  # type: ignore[union-attr]

    def _ready(self, now: float, run: _Run, req: TraceRequest, step: int, arrival: float, computed: int, h: int,
               d: int, rid: str) -> None:
        """The request's loads are done: queue its prefill (at least the last token is always computed)."""
        first = self.server.prefill(now, max(computed, 1))
        done = first + self.server.decode_seconds(req.output_tokens)
        self._ttft.append(first - arrival)
        self._last_done = max(self._last_done, done)
        if self.record:
            parent = run.parent.ident if run.parent is not None else -1
            self.result.records.append(RequestRecord(run.ident, parent, step, arrival, first, done, h, d, computed))
        self._push(done, _DONE, (run, req, step, rid))
        if self.progress is not None:
            self._unreported += 1
            if self._unreported >= 64:
                self.progress(self._unreported)
                self._unreported = 0

    def _done(self, now: float, run: _Run, req: TraceRequest, step: int, rid: str) -> None:
        """The request's answer is out: the server tells the store (and the harness its hints), then the agent
        takes its next step."""
        if self.store is not None:
            hints = []
            if self.config.hints and run.ident != -1:
                following = run.steps[step + 1] if step + 1 < len(run.steps) else None
                if following is None:
                    hints.append(Hint(rid, time=now, finished=True))
                elif not isinstance(following, TraceRequest) and following.agents:
                    hints.append(Hint(rid, time=now, subagents=len(following.agents)))
            self.store.observe(completions=[Completion(rid, now, req.stop)], hints=hints)
        if run.ident != -1:
            run.index += 1
            self._advance(run, now)

    def _finish(self, now: float, cpu_s: float) -> ReplayResult:
        res = self.result
        if self.progress is not None and self._unreported:
            self.progress(self._unreported)
        res.virtual_s = max(now, self._last_done)
        res.prefill_busy_s = self.server.prefill_busy_s
        res.cpu_s = cpu_s
        res.ttft_s = np.asarray(self._ttft)
        res.stream = self._stream[: self._streamed]
        res.capacity_blocks[HBM] = self.hbm.capacity
        if self.prefetch is not None:
            c = self.prefetch.prefetcher.counts
            res.prefetch = {"prefetched": c.prefetched, "used": c.used, "wasted": c.wasted, "cancelled": c.cancelled,
                            **{f"from_{t}": n for t, n in c.from_tier.items()}}
            res.channel_s = self.prefetch.seconds()
        if self.store is not None:
            sim_bytes = self.store.block_bytes
            for tier in self.store.tiers:
                st = tier.stats()
                res.capacity_blocks[tier.name] = st.capacity_bytes // sim_bytes
                res.bytes_loaded[tier.name] = st.hits * self.real_block_bytes
                res.bytes_stored[tier.name] = st.puts * self.real_block_bytes
        return res
