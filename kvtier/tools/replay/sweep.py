"""Sweep: replay one Workload for every (lower-tier capacity, policy) pair and attach the offline limits.

The workload is parsed and its keys hashed once; each run builds a fresh real TieredStore whose tiers hold
``capacity_bytes // real_block_bytes`` blocks of ``SIM_BLOCK_BYTES`` stand-in bytes each, so the real store
code (dedup, lookups, the eviction policies) runs at the real block counts without allocating real bytes.
Each run's own access stream gives its OPT and infinite-cache limits (memoised when two runs' streams match).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import functools
import itertools
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvtier.config import Config
from kvtier.keys import Namespace
from kvtier.layout import BlockLayout
from kvtier.policies import Clock, policy_class
from kvtier.tools.replay.hybrid import HybridModel
from kvtier.tools.replay.hybrid_replay import Objects
from kvtier.tools.replay.opt import Limits, LimitsCache
from kvtier.tools.replay.replayer import HBM, ReplayConfig, Replayer, ReplayResult, VirtualClock
from kvtier.tools.replay.service import ServiceModel
from kvtier.tools.replay.sizing import Capacity
from kvtier.tools.replay.workload import Workload
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

# Stand-in bytes per block in the replay's store: enough for the store's copies to be real, small enough that
# a 256 GiB tier of 8 MiB blocks (32,768 blocks) takes 2 MiB. A tier with alignment needs can raise it.
SIM_BLOCK_BYTES = 64



class ProgressBar(Protocol):
    """What a progress factory returns (a tqdm bar is one)."""

    def update(self, n: int) -> Any: ...

    def close(self) -> Any: ...


ProgressFactory = Callable[[str, int], ProgressBar | None]


@dataclass
class PolicyRun:
    """One policy at one capacity point: the replay's measurements and the limits on its own stream."""

    policy: str
    result: ReplayResult
    limits: Limits
    block_tokens: int
    opt_cpu_s: float = 0.0
    store_limits: Limits | None = None  # OPT at the store's capacity alone (HBM left out); None without a store

    def _rate(self, blocks: int) -> float:
        n = self.result.input_tokens
        return blocks * self.block_tokens / n if n else 0.0

    @property
    def opt_hit_rate(self) -> float:
        return self._rate(self.limits.opt)

    @property
    def infinite_hit_rate(self) -> float:
        return self._rate(self.limits.infinite)

    @property
    def opt_dram_only_hit_rate(self) -> float:
        """Belady's optimum for the store's tiers alone, without HBM: what a DRAM-only cache of DRAM's size
        could reach (DRAM and the lower tiers where the store has them). With write-through the hierarchy is
        inclusive (a block in HBM is in DRAM too), so this is the bound a DRAM policy's choices play against;
        ``opt_hit_rate`` (HBM + store) bounds the system."""
        return self._rate(self.store_limits.opt) if self.store_limits is not None else 0.0


@dataclass
class SweepPoint:
    """All policies at one set of capacities (blocks per tier, HBM included)."""

    capacity_blocks: dict[str, int]
    labels: dict[str, str]
    runs: dict[str, PolicyRun] = field(default_factory=dict)

    @property
    def opt_hit_rate(self) -> float:
        """The largest OPT over the policies' streams: an upper bound for every policy of this point."""
        return max((r.opt_hit_rate for r in self.runs.values()), default=0.0)

    @property
    def infinite_hit_rate(self) -> float:
        return max((r.infinite_hit_rate for r in self.runs.values()), default=0.0)

    @property
    def opt_dram_only_hit_rate(self) -> float:
        """The largest store-only OPT over the policies' streams (PolicyRun.opt_dram_only_hit_rate)."""
        return max((r.opt_dram_only_hit_rate for r in self.runs.values()), default=0.0)


# Not a Config key: the size of a second node's DRAM (a kvtier-pool started for the run, under this node's DRAM).
POOL_KEY = "pool_capacity"


def capacity_keys() -> list[str]:
    """Keys that size a store tier: the Config's (``dram_capacity``, ``ssd_capacity``, ...) and ``pool_capacity``."""
    return [f.name for f in fields(Config) if f.name.endswith("_capacity") and f.metadata.get("kind") == "bytes"
            and f.name != "standalone_dram_capacity"] + [POOL_KEY]


# Settings that keep a lower tier exact and deterministic under stand-in blocks, applied where the Config has
# them (a --set overrides): the SSD tier's O_DIRECT would round 64 B blocks up to 4 KiB slots (64x fewer
# blocks), and its write-behind would make hits depend on thread timing instead of the trace.
# The same for the pool: no write-behind (its thread's timing would decide hits), one connection (a batch cut
# into requests goes in order, not in whichever order parallel lanes reach the pool), and a timeout long enough
# that a busy machine never turns a block into a miss.
REPLAY_DEFAULTS: dict[str, Any] = {"ssd_direct_io": "false", "ssd_fsync": False, "ssd_staging_bytes": 0,
                                   "pool_staging_bytes": 0, "pool_timeout_ms": 10_000, "pool_connections": 1}
# Config keys naming a directory a tier keeps files in: each run gets a fresh one under it, removed afterwards,
# so no run finds the blocks of the run before it (salted keys repeat from run to run).
RUN_DIRECTORIES = ("ssd_path",)


@contextmanager
def build_store(policy: str, tier_blocks: Mapping[str, int], extra: Mapping[str, Any],
                sim_block_bytes: int = SIM_BLOCK_BYTES, clock: Clock | None = None) -> Iterator[TieredStore | None]:
    """A real TieredStore whose tiers hold ``tier_blocks[config key]`` blocks (None when DRAM is 0), closed
    and its tiers' run directories removed on exit. A pool tier is a kvtier-pool process of its own, evicting
    by ``policy`` too, stopped on exit: a fresh one per run, since emptying a pool would keep its policy's
    history (S3-FIFO's ghost queue) and salted keys repeat from run to run."""
    if tier_blocks.get("dram_capacity", 0) <= 0:
        others = [k for k, v in tier_blocks.items() if v > 0 and k != "dram_capacity"]
        if others:
            raise ValueError(f"{', '.join(others)} need a DRAM tier above them; give --dram > 0")
        yield None
        return
    known = {f.name for f in fields(Config)}
    values = {k: v for k, v in REPLAY_DEFAULTS.items() if k in known}
    values.update(extra)
    for key, blocks in tier_blocks.items():
        if key == POOL_KEY:
            continue
        if blocks > 0:
            values[key] = blocks * sim_block_bytes
        else:  # a lower tier sized 0 is off: drop its directory too (a sweep like --ssd 0,50%)
            values.pop(key.removesuffix("_capacity") + "_path", None)
    values["eviction"] = policy
    with ExitStack() as cleanup:
        pool_blocks = tier_blocks.get(POOL_KEY, 0)
        if pool_blocks > 0:  # a second node's DRAM: a real kvtier-pool process, reached over loopback TCP
            from kvtier.pool.process import PoolDaemon

            # its policy reads the replay's virtual time from the observations the store sends it
            pool = cleanup.enter_context(PoolDaemon(pool_blocks * sim_block_bytes, sim_block_bytes, eviction=policy,
                                                    policy_clock="sender"))
            values.update(mode="distributed", pool=pool.endpoint("tcp"))
        for key in RUN_DIRECTORIES:
            if values.get(key):
                Path(values[key]).mkdir(parents=True, exist_ok=True)
                values[key] = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="run-", dir=values[key]))
        store = TieredStore.from_config(Config.from_dict(values), sim_block_bytes, clock=clock)
        try:
            yield store
        finally:
            store.close()


class Sweep:
    """Runs the grid, one run at a time here or on worker processes (``run``); each run owns and closes its
    store."""

    def __init__(
        self, workload: Workload, layout: BlockLayout, model: str, hbm: Capacity, tiers: Mapping[str, list[Capacity]],
        policies: list[str], service: ServiceModel, config: ReplayConfig, extra_config: Mapping[str, Any] | None = None,
        progress: ProgressFactory | None = None, sim_block_bytes: int = SIM_BLOCK_BYTES,
        hybrid: HybridModel | None = None, share_bytes: int | None = None,
        prefetch: list[bool] | None = None,
    ) -> None:
        known = capacity_keys()
        for key in tiers:
            if key not in known:
                raise ValueError(f"unknown tier capacity key {key!r}; known: {', '.join(known)}")
        for p in policies:
            policy_class(p)  # an unknown policy fails now, not after the first runs
        if not policies:
            raise ValueError("no eviction policy given")
        self.workload, self.layout, self.model = workload, layout, model
        self.hbm, self.tiers, self.policies = hbm, dict(tiers), list(policies)
        self.service, self.config = service, config
        self.extra = dict(extra_config or {})
        self.progress, self.sim_block_bytes = progress, sim_block_bytes
        # Prefetch between turns, on and/or off: each policy runs once per setting (named by run_name).
        self.prefetch = list(prefetch) if prefetch else [config.prefetch]
        self.namespace = Namespace(f"replay:{model}", layout.fingerprint)
        self.limits = LimitsCache()
        # A hybrid model storing only what can be used (hybrid_replay.py): its store slots (and HBM's) stand for
        # the full-history groups' bytes of one block, and a capacity in bytes is that many slots.
        self.hybrid = hybrid
        self.objects = Objects.of(hybrid, workload.block_tokens) if hybrid is not None else None
        self.share_bytes = share_bytes or layout.nbytes  # a block's bytes a capacity's percentage counts

    @property
    def block_bytes(self) -> int:
        """One trace block's bytes with every cache group whole."""
        return self.layout.nbytes

    @property
    def unit_bytes(self) -> int:
        """The real bytes one store slot stands for: a whole block, or a hybrid model's full-history block."""
        return self.objects.unit_bytes if self.objects is not None else self.layout.nbytes

    def slots(self, capacity: Capacity) -> int:
        """Store (or HBM) slots of ``capacity``: its bytes over ``unit_bytes``."""
        return capacity.nbytes_of(self.workload.unique_blocks, self.share_bytes) // self.unit_bytes

    def label(self, capacity: Capacity) -> str:
        return capacity.label(self.workload.unique_blocks, self.share_bytes)

    def points(self) -> list[dict[str, Capacity]]:
        """Every combination of the tiers' capacities, in the order given (the last tier varies fastest)."""
        grid: list[dict[str, Capacity]] = [{}]
        for key, caps in self.tiers.items():
            grid = [{**g, key: c} for g in grid for c in caps]
        return grid

    def run(self, pool: RunPool | None = None) -> list[SweepPoint]:
        """Every run of the grid, in this process one after another, or spread over ``pool``'s worker
        processes: each run builds its own store and replays on its own virtual clock, so its result does not
        depend on where or beside what it ran."""
        hbm_blocks = self.slots(self.hbm)
        out, grid = [], []
        for caps in self.points():
            blocks = {k: self.slots(c) for k, c in caps.items()}
            labels = {HBM: self.label(self.hbm), **{k.removesuffix("_capacity"): self.label(c)
                                                    for k, c in caps.items()}}
            point = SweepPoint({HBM: hbm_blocks, **{k.removesuffix("_capacity"): v for k, v in blocks.items()}},
                               labels)
            grid += [(point, policy, blocks, labels, pf) for policy in self.policies for pf in self.prefetch]
            out.append(point)
        if pool is None:
            for point, policy, blocks, labels, pf in grid:
                point.runs[self.run_name(policy, pf)] = self.run_one(policy, hbm_blocks, blocks, labels, prefetch=pf)
            return out
        shipped = copy.copy(self)  # what a worker needs: no progress callback (a closure over a tty)
        shipped.progress = None
        shipped.limits = LimitsCache()
        calls = [functools.partial(shipped.run_one, policy, hbm_blocks, blocks, labels, prefetch=pf)
                 for _, policy, blocks, labels, pf in grid]
        bar = self.progress(f"{len(grid)} runs", self.workload.requests * len(grid)) if self.progress else None
        try:
            runs = pool.map(calls, on_result=(lambda run: bar.update(run.result.requests)) if bar else None)
        finally:
            if bar is not None:
                bar.close()
        for (point, policy, _, _, pf), run in zip(grid, runs):
            point.runs[self.run_name(policy, pf)] = run
        return out

    def run_name(self, policy: str, prefetch: bool) -> str:
        """A run's name in the report: the policy, with "+pf" / "-pf" when prefetch is swept on and off."""
        if len(self.prefetch) < 2:
            return policy
        return f"{policy}{'+pf' if prefetch else '-pf'}"

    def run_one(self, policy: str, hbm_blocks: int, tier_blocks: Mapping[str, int],
                labels: Mapping[str, str] | None = None, record: bool = False,
                prefetch: bool | None = None) -> PolicyRun:
        desc = f"{policy} " + " ".join(f"{k}={v}" for k, v in (labels or {}).items())
        config = self.config if prefetch is None else dataclasses.replace(self.config, prefetch=prefetch)
        bar = self.progress(desc, self.workload.requests) if self.progress else None
        clock = VirtualClock()
        try:
            with build_store(policy, tier_blocks, self.extra, self.sim_block_bytes, clock) as store:
                replayer = Replayer(self.workload, self.namespace, store, hbm_blocks, self.unit_bytes,
                                    self.service, config, progress=bar.update if bar is not None else None,
                                    record=record, clock=clock, hybrid=self.hybrid)
                result = replayer.run()
        finally:
            if bar is not None:
                bar.close()
        t0 = time.process_time()
        capacity = sum(result.capacity_blocks.values())
        limits = self.limits.limits(result.stream, capacity)
        store_capacity = capacity - result.capacity_blocks.get(HBM, 0)
        store_limits = self.limits.limits(result.stream, store_capacity) if store_capacity > 0 else None
        opt_cpu = time.process_time() - t0
        log.info("%s: hit rate %.4f, OPT %.4f (%.1f s CPU), %d requests in %.1f s CPU", desc,
                 result.hit_rate, limits.opt * self.workload.block_tokens / max(result.input_tokens, 1), opt_cpu,
                 result.requests, result.cpu_s)
        result.stream = np.empty(0, np.int32)  # hundreds of MB for a large set; the limits are all we keep
        return PolicyRun(policy, result, limits, self.workload.block_tokens, opt_cpu, store_limits)


class RunPool:
    """Worker processes for ``Sweep.run``, reusable across sweeps (a worker's imports, torch's ~2 s of CPU
    among them, are paid once). Spawned, not forked: this process may hold threads (a progress bar's, the
    executor's own) that a fork would copy mid-lock. A worker takes a Ctrl-C as this process would (the run
    under way closes its store and stops its pool daemon), and no run waits queued in a worker: a run is
    handed out only when a worker is free, so an interrupted sweep starts nothing more."""

    def __init__(self, jobs: int) -> None:
        if jobs < 2:
            raise ValueError(f"a pool of workers needs jobs >= 2, got {jobs}")
        self.jobs = jobs
        self._executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker,
                                             initargs=(logging.getLogger().getEffectiveLevel(),))

    def map(self, calls: list[Callable[[], PolicyRun]],
            on_result: Callable[[PolicyRun], Any] | None = None) -> list[PolicyRun]:
        """Each call's result, in the calls' order; ``on_result`` sees each as it ends. The first error is
        raised once the calls under way have ended (those not started never are)."""
        results: dict[int, PolicyRun] = {}
        running: dict[Future[PolicyRun], int] = {}
        todo = iter(enumerate(calls))
        try:
            while True:
                for i, call in itertools.islice(todo, self.jobs - len(running)):
                    running[self._executor.submit(call)] = i
                if not running:
                    return [results[i] for i in range(len(calls))]
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    results[running.pop(future)] = run = future.result()
                    if on_result is not None:
                        on_result(run)
        finally:
            wait(running)  # what a run under way holds (its store, a pool daemon) is released before we go on

    def close(self) -> None:
        self._executor.shutdown()

    def __enter__(self) -> RunPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_pool(jobs: int) -> RunPool | None:
    """Worker processes for ``Sweep.run``, or None for ``jobs`` <= 1 (runs stay in this process)."""
    return RunPool(jobs) if jobs > 1 else None


def _start_worker(level: int) -> None:
    """A worker logs at its parent's level (a spawned process starts with no logging set up)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
