"""Transfers: the worker's two copy threads, engine KV <-> host staging rows <-> the store.

Runs in a vLLM worker process. The engine's thread only queues jobs; each job runs on the loader or the
saver thread, so neither the forward nor the scheduler waits for a copy unless it asked to
(``LoadJob.wait_layer`` for a layer-wise load, ``SaveJob.gathered`` before a preempted request's blocks are
reused).

* Load: blocks in DRAM are scattered straight from their slots (``store.borrow``: one copy, the slots held
  until the copy is done); the others are read with ``store.get`` into host staging rows first (an SSD hit
  is promoted to DRAM; a miss's engine block id becomes a load error). One scatter per layer writes them
  into the engine's blocks; layer i is ready once its last scatter is done (GPU: recorded as an event the
  forward's stream waits on). The job's lookup lease is released at the end: its pins protected the blocks
  until now.
* Save: one ``store.prepare_put`` per job says, once per key, what the store holds or another save is
  writing: those are skipped before any copy (only new blocks cost a gather; no master is asked); the rest
  are gathered straight into DRAM slots the store reserved for them (``plan.put_in_place``: one copy, the
  keys published once the gather is done). Where the slots cannot be addressed (the node pool on top of a
  standalone store; GPU KV with a pageable DRAM buffer) they are gathered into staging rows and
  ``plan.put`` copies them again. An agent's hints then lease the request's blocks.

Staging is ``staging_bytes`` of host memory per direction (page-locked when CUDA is present; saves have none
where they write in place); a job larger than that goes through it, or into slots, in chunks of that size.
On a GPU each thread copies on its own stream, ordered after the compute stream's work at the time the job
was queued. Thread-safe: any thread may submit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from kvtier.blocks import BlockRows
from kvtier.memory.hostmem import HostBuffer
from kvtier.store.leases import LeaseTable, session_lease
from kvtier.kernels import SKIP
from kvtier.store import TieredStore

from .hints import AgentHints
from .pagedkv import PagedKV

log = logging.getLogger(__name__)

def lookup_lease(lease: int) -> str:
    return f"lookup:{lease}"


@dataclass(eq=False)  # a job is an identity, not a value
class LoadJob:
    """Load ``keys`` into engine blocks ``block_ids``. ``failed`` (engine block ids) is final once ``done``."""

    req_id: str
    lease: int
    keys: list[bytes]
    hashes: Sequence[bytes]
    block_ids: np.ndarray
    layerwise: bool
    kv: PagedKV  # the engine KV of the blocks' cache group
    final: bool = True  # the request's last load job of the step: it ends the lookup's lease
    group: int = 0  # vLLM's KV cache group of the blocks
    failed: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    after: Any = None  # GPU: the compute stream's event the copies wait for
    layer_ready: list[threading.Event] = field(default_factory=list)
    layer_events: list[Any] = field(default_factory=list)  # GPU: per-layer events for the compute stream

    def __post_init__(self) -> None:
        self.layer_ready = [threading.Event() for _ in range(self.kv.num_layers)]
        self.layer_events = [None] * self.kv.num_layers

    def wait_layer(self, layer: int, timeout: float) -> bool:
        """Block until layer ``layer`` is in the engine's blocks (GPU: until it is queued, then make the
        current stream wait for it). False on timeout: the job is cancelled and every block is a failure."""
        if not self.layer_ready[layer].wait(timeout):
            self.cancel()
            return False
        if self.layer_events[layer] is not None:
            torch.cuda.current_stream().wait_event(self.layer_events[layer])
        return True

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(eq=False)
class SaveJob:
    """Store engine blocks ``block_ids`` under ``keys`` (``hashes`` are the engine's names for them)."""

    req_id: str
    keys: list[bytes]
    hashes: Sequence[bytes]
    block_ids: np.ndarray
    kv: PagedKV  # the engine KV of the blocks' cache group
    hints: AgentHints | None = None
    group: int = 0  # vLLM's KV cache group of the blocks
    gathered: threading.Event = field(default_factory=threading.Event)  # engine blocks no longer read
    done: threading.Event = field(default_factory=threading.Event)
    after: Any = None


Naming = Callable[[Sequence[bytes], Sequence[bytes]], AbstractContextManager[None]]


class Transfers:
    """The loader and saver threads of one worker; a load ends its lookup's lease in ``lookup_leases``.
    ``on_load_done`` / ``on_save_done`` are called on those
    threads when a job ends (keep them short). Store calls run inside ``naming(keys, hashes)``, so whoever
    listens to the store's events can tell the keys' engine hashes (the KV events recorder)."""

    def __init__(self, store: TieredStore, lookup_leases: LeaseTable, kv: PagedKV, staging_bytes: int, *,
                 on_load_done: Callable[[LoadJob], None], on_save_done: Callable[[SaveJob], None],
                 naming: Naming | None = None, save_in_place: bool = True) -> None:
        self.store = store
        self.lookup_leases = lookup_leases
        self.kv = kv
        self._on_load_done, self._on_save_done = on_load_done, on_save_done
        self._naming: Naming = naming or (lambda keys, hashes: nullcontext())
        gpu = kv.device.type == "cuda"
        # Loads read DRAM slots in place when the copy kernels can address them: always for CPU KV, for GPU
        # KV only when the DRAM buffer is page-locked (then the GPU reads it over PCIe directly). Saves then
        # write them in place too, if the top tier has slots (``save_in_place`` False: always staged, to
        # compare the two in ``kvtier bench vllm``).
        self._direct = not gpu or store.pinned_memory
        self._save_in_place = save_in_place and self._direct and store.writes_in_place
        rows = self._chunk_rows = max(1, staging_bytes // kv.layout.nbytes)
        self._buffers = [HostBuffer(rows * kv.layout.nbytes) for _ in range(1 if self._save_in_place else 2)]
        self._load_rows = self._buffers[0].tensor.view(rows, kv.layout.nbytes)
        self._save_rows = (self._buffers[1].tensor.view(rows, kv.layout.nbytes) if len(self._buffers) > 1
                           else torch.empty(0, kv.layout.nbytes, dtype=torch.uint8))  # in place: no staging
        self._load_stream = torch.cuda.Stream(kv.device) if gpu else None
        self._save_stream = torch.cuda.Stream(kv.device) if gpu else None
        self._lock = threading.Lock()
        self.counters = {"load_blocks": 0, "load_bytes": 0, "load_failed_blocks": 0, "load_seconds": 0.0,
                         "save_blocks": 0, "save_bytes": 0, "save_skipped_blocks": 0, "save_rejected_blocks": 0,
                         "save_in_place_blocks": 0, "save_staged_blocks": 0, "save_seconds": 0.0}
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._saves: queue.Queue[SaveJob | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._serve, args=(self._loads, self._load), daemon=True,
                                          name="kvtier-load"),
                         threading.Thread(target=self._serve, args=(self._saves, self._save), daemon=True,
                                          name="kvtier-save")]
        for t in self._threads:
            t.start()
        log.info("kvtier transfers: %d staging rows of %d B (%s) for loads%s", rows, kv.layout.nbytes,
                 "pinned" if self._buffers[0].pinned else "pageable",
                 "; saves gather straight into DRAM slots" if self._save_in_place else " and for saves")

    @property
    def saves_in_place(self) -> bool:
        """Whether saves gather straight into DRAM slots (one copy) rather than through staging rows (two)."""
        return self._save_in_place

    def submit_load(self, job: LoadJob) -> None:
        job.after = _stream_mark(self.kv.device)
        self._loads.put(job)

    def submit_save(self, job: SaveJob) -> None:
        job.after = _stream_mark(self.kv.device)
        self._saves.put(job)

    def take_counters(self) -> dict[str, float]:
        """The counters since the last call (and reset them)."""
        with self._lock:
            out = dict(self.counters)
            for k in self.counters:
                self.counters[k] = 0 if isinstance(self.counters[k], int) else 0.0
        return out

    def close(self) -> None:
        self._loads.put(None)
        self._saves.put(None)
        for t in self._threads:
            t.join(timeout=30)
        for b in self._buffers:
            b.close()

    # ---- the two threads -------------------------------------------------------------------------------

    def _serve(self, jobs: queue.Queue[Any], run: Callable[[Any], None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            run(job)

    def _load(self, job: LoadJob) -> None:
        start = time.perf_counter()
        n, rows, loaded = len(job.keys), len(self._load_rows), 0
        try:
            with _on_stream(self._load_stream, job.after):
                for lo in range(0, n, rows):
                    hi = min(n, lo + rows)
                    loaded += self._load_chunk(job, lo, hi, last=hi == n)
                    if job.cancelled:
                        break
        except Exception:
            log.exception("kvtier: load of %d blocks for request %s failed; they will be recomputed", n, job.req_id)
            job.cancel()
        if job.cancelled:  # a layer may be half written: every block of the job is a failure
            job.failed = job.block_ids.tolist()
            loaded = 0
        if job.final:  # one thread runs a request's jobs in order: the last one ends the pins of all
            self.lookup_leases.release(lookup_lease(job.lease))
        for ready in job.layer_ready:
            ready.set()
        self._count(load_blocks=loaded, load_bytes=loaded * job.kv.layout.nbytes,
                    load_failed_blocks=len(job.failed), load_seconds=time.perf_counter() - start)
        self._finish(job, self._on_load_done)

    def _load_chunk(self, job: LoadJob, lo: int, hi: int, last: bool) -> int:
        """Blocks [lo, hi) of the job: the ones in DRAM straight from their slots (one copy), the others
        through staging rows (``store.get`` reads the SSD and promotes). Returns how many were loaded."""
        keys, ids = job.keys[lo:hi], job.block_ids[lo:hi]
        with (self.store.borrow(keys) if self._direct else nullcontext([None] * len(keys))) as addresses:
            direct = [i for i, a in enumerate(addresses) if a is not None]
            rest = [i for i, a in enumerate(addresses) if a is None]
            slots = BlockRows(np.array([addresses[i] for i in direct], dtype=np.uint64), ())
            staging = self._load_rows[: len(rest)]
            rest_ids = ids[rest].copy()
            if rest:
                with self._naming([keys[i] for i in rest], [(job.hashes[lo + i], job.group) for i in rest]):
                    hit = self.store.get([keys[i] for i in rest], staging)  # an SSD hit is promoted to DRAM
                missed = ~np.asarray(hit, dtype=bool)
                job.failed += rest_ids[missed].tolist()
                rest_ids[missed] = SKIP
            for layer in range(job.kv.num_layers):
                if job.cancelled:
                    break
                if direct:
                    job.kv.scatter_layer(layer, ids[direct], slots)
                if rest:
                    job.kv.scatter_layer(layer, rest_ids, staging)
                if last:
                    job.layer_events[layer] = _record(self._load_stream)
                    job.layer_ready[layer].set()
            if self._load_stream is not None:
                self._load_stream.synchronize()  # slots and staging rows are reused once this returns
        return len(direct) + int((rest_ids != SKIP).sum())

    def _save(self, job: SaveJob) -> None:
        start = time.perf_counter()
        try:
            stored = rejected = 0
            rows = self._chunk_rows
            # One answer per key, given once: what the store holds (or another save is writing) is skipped
            # before any gather, and the rest is claimed until its chunks are written.
            with self.store.prepare_put(job.keys) as plan, _on_stream(self._save_stream, job.after):
                todo = plan.fresh
                for lo in range(0, len(todo), rows):
                    part = todo[lo : lo + rows]
                    last = lo + rows >= len(todo)
                    with self._naming([job.keys[i] for i in part], [(job.hashes[i], job.group) for i in part]):
                        if self._save_in_place:
                            result = plan.put_in_place(part, partial(self._gather_into_slots, job, last))
                        else:
                            staging = self._save_rows[: len(part)]
                            self._gather(job, part, staging, last)
                            result = plan.put(part, staging)
                    stored += result.stored
                    rejected += len(result.rejected)
                skipped = plan.skipped  # a plan's writes skip nothing: it decided what to skip
            job.gathered.set()
            if job.hints is not None:
                self.store.leases.lease(session_lease(job.hints.session), job.keys, job.hints.ttl_s,
                                        job.hints.priority)
            path = "save_in_place_blocks" if self._save_in_place else "save_staged_blocks"
            self._count(save_blocks=stored, save_bytes=stored * job.kv.layout.nbytes,
                        save_skipped_blocks=skipped, save_rejected_blocks=rejected,
                        save_seconds=time.perf_counter() - start, **{path: stored})
        except Exception:  # best effort: a failed save is a future miss, never a stuck request
            log.exception("kvtier: save of %d blocks for request %s failed", len(job.keys), job.req_id)
        job.gathered.set()
        self._finish(job, self._on_save_done)

    def _gather_into_slots(self, job: SaveJob, last: bool, index: list[int], slots: BlockRows) -> None:
        """A PutPlan's fill: the job's blocks ``index`` (positions in ``job.keys``) into DRAM slots ``slots``."""
        self._gather(job, index, slots, last)

    def _gather(self, job: SaveJob, which: list[int], packed: torch.Tensor | BlockRows, last: bool) -> None:
        """Gather the job's blocks ``which`` into ``packed`` (staging rows or DRAM slots) and wait for it."""
        job.kv.gather(job.block_ids[which], packed)
        if self._save_stream is not None:
            self._save_stream.synchronize()
        if last:
            job.gathered.set()  # the engine's blocks are not read any more

    def _finish(self, job: Any, callback: Callable[[Any], None]) -> None:
        job.done.set()
        try:
            callback(job)
        except Exception:
            log.exception("kvtier: completion callback failed for request %s", job.req_id)

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v


@contextmanager
def _on_stream(stream: Any, after: Any) -> Iterator[None]:
    """Run the block on ``stream`` (GPU) after ``after`` (an event on the compute stream); no-op on CPU."""
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield


def _stream_mark(device: torch.device) -> Any:
    """An event at the current end of the compute stream (GPU), so a copy queued later on another stream
    starts only after the work the engine queued so far (this step's forward) has run."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _record(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
