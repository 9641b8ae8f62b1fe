"""Offload and promotion between a store's top tier (host DRAM) and each tier under it (the remote pool, the SSD).

Runs inside TieredStore, in the caller's process, on the threads of the store calls that trigger it; it holds
no bytes itself: the lower tier's ``put_later`` copies what is offloaded into its own staging memory before it
returns, so a DRAM slot can be reused at once and a write queued before DRAM evicts its block still lands.

One offload policy per lower tier (policies.py: write_through, on_evict, second_hit, or one registered by name)
says when blocks go down. Every policy also writes, on eviction, a block that should be on the disk but is not
(its write-through copy was dropped: staging full, or the disk stopped admitting then). A block a put offered
that DRAM did not take (its policy declined it: admission; full of pinned blocks; a batch larger than DRAM)
goes down as if DRAM had evicted it at once (an in-place put fills it into scratch rows for that:
writes.TopWrites.fill): with write_through the whole batch reaches the disk, as far as the disk has room.
On close (``write_down``) DRAM is about to vanish as if evicted whole: every block the policy would write on
eviction and the lower tier lacks is written, until a deadline; what is left when it passes is lost with the
process (the count is logged).
Promotion (``promote``): a block served by the lower tier is copied into DRAM as well, so the session's next
turn finds it there; it stays on disk too, so evicting it again costs no write. The store does the copy, through
its own put path (TieredStore._promote: one way into a tier); the offloader says whether and counts it.
Prefetch (kvtier/prefetch/, TieredStore.bring_up): with on_evict the two tiers hold distinct blocks, and a block
a prefetch brings up *leaves* a private lower tier (``prefetched``; the SSD, a HandsUp tier; a pool other engines
read keeps its copy): a copy in both spends a slot of the lower tier on what DRAM holds, and the full SSD then
declined DRAM's later victims (replay, standard slice, ssd_promote false: 0.935 of input tokens served against
0.950 with the move, the infinite cache's). DRAM's eviction writes the block down again (on_evict: the lower tier
lacks it), so the SSD writes more (about 3x in that replay) to hold more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvtier.blocks import BlockRows
from kvtier.offload.policies import OffloadPolicy, offload_policy
from kvtier.tiers.base import AddressableSlots, HandsUp, RemoteTier, Tier, WriteBehindStaging

log = logging.getLogger(__name__)

Emit = Callable[[str, str, list[bytes]], None]  # (kind, tier name, keys): the store's event hook


class Sightings:
    """How often each recent key was put or hit: second_hit's memory. One per store, fed by the store once per
    put, get and borrow and read by all its offloaders (so a sighting counts once, whatever the number of lower
    tiers); the least recently seen keys beyond ``capacity`` are forgotten. Thread-safe."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def see(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            seen = self._seen
            for k in keys:
                seen[k] = seen.get(k, 0) + 1
                seen.move_to_end(k)
            while len(seen) > self._capacity:
                seen.popitem(last=False)

    def counts(self, keys: Sequence[bytes]) -> list[int]:
        with self._lock:
            get = self._seen.get
            return [get(k, 0) for k in keys]


class Offloader:
    """Moves blocks between ``top`` and ``lower`` by ``policy`` (an OffloadPolicy, or its registered name).
    Thread-safe. Every hook runs on the store caller's thread, outside the top tier's lock: ``on_top_evict``
    inside the reserve that evicted (the victims stay readable in the top tier, and their slots unwritten, until
    it returns), so it may write to a lower tier that stages nothing, but only waits for staging memory where the
    policy says so (never on eviction)."""

    def __init__(self, top: Tier, lower: Tier, policy: str | OffloadPolicy = "on_evict", *, promote: bool = True,
                 emit: Emit | None = None, sightings: Sightings | None = None, index: int = 1) -> None:
        self.policy: OffloadPolicy = offload_policy(policy)  # ValueError naming the known ones
        self.top, self.lower, self.promote = top, lower, promote
        self.index = index  # the lower tier's position in the store (the ``served`` value after_get sees)
        # What the two tiers declare (kvtier.tiers.base), decided once here.
        self._staging: WriteBehindStaging | None = lower if isinstance(lower, WriteBehindStaging) else None
        self._remote: RemoteTier | None = lower if isinstance(lower, RemoteTier) else None
        self._top_slots: AddressableSlots | None = top if isinstance(top, AddressableSlots) else None
        self._hands_up: HandsUp | None = lower if isinstance(lower, HandsUp) and self.policy.moves_up else None
        self._emit = emit or (lambda kind, tier, keys: None)
        # second_hit's memory: the store's (it records each put, get and borrow there once), else an empty one.
        self._sightings = sightings if sightings is not None else Sightings()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    # ---- hooks the store calls ----------------------------------------------------------------------

    def after_put(self, keys: Sequence[bytes], rows: BlockRows, refused: Sequence[bytes] = (),
                  refused_rows: BlockRows | None = None) -> None:
        """``keys`` were just stored in the top tier from ``rows``; ``refused`` (from ``refused_rows``) were
        offered by the same put but the top tier had no room for them (rows valid during this call). The store
        has recorded both as sightings already."""
        if self.policy.on_put and keys:
            self._offload(list(keys), rows, wait=True)
        if refused and refused_rows is not None:
            self._refused_by_top(refused, refused_rows)

    def _refused_by_top(self, keys: Sequence[bytes], rows: BlockRows) -> None:
        """Blocks the top tier could not take go down as its evictions would (write_through: all of them, waiting
        for staging memory as its puts do; the other policies: what they write on eviction, never waiting)."""
        wanted = self.due_on_eviction(keys)
        if wanted:
            sub = rows if len(wanted) == len(keys) else BlockRows(rows.ptrs[wanted], rows.owners)
            self._offload([keys[i] for i in wanted], sub, wait=self.policy.on_put)

    def on_top_evict(self, keys: Sequence[bytes], views: Sequence[Any]) -> None:
        """The top tier evicts ``keys``; ``views`` of their bytes are valid during this call only."""
        wanted = self.due_on_eviction(keys)
        if wanted:
            self._offload([keys[i] for i in wanted], [views[i] for i in wanted], wait=False)

    def due_on_eviction(self, keys: Sequence[bytes], *, count: bool = True) -> list[int]:
        """Positions of ``keys`` the policy writes down when they leave the top tier (or the top tier does not
        take them): those the lower tier lacks, as the policy's ``due`` picks them. ``count`` False: a question
        only (an in-place put asks which of its refused blocks to fill into scratch rows), nothing counted."""
        # This runs on every eviction, inside the put that evicted: a remote tier's contains is a network round
        # trip, so it answers from what it knows locally (``held_locally``: sent or fetched recently); the pool
        # skips the rest if held.
        lacking = [i for i, h in enumerate(self._lower_holds(keys)) if not h]
        wanted = self.policy.due(keys, lacking, lambda: self._sightings.counts(keys))
        if count and len(wanted) < len(lacking):  # the policy passed over some (second_hit: seen once)
            with self._lock:
                self._counts[self.policy.skipped] += len(lacking) - len(wanted)
        return wanted

    def prefetched(self, keys: Sequence[bytes], session: str, depths: Sequence[int]) -> bool:
        """A prefetch copied ``keys`` (this offloader's lower tier served them; at ``depths`` of agent
        ``session``'s chain) into the top tier, which holds them pinned during this call: a private lower tier
        under on_evict gives them up (module docstring); True if it did. Pinned, because an eviction between the
        copy and the drop would leave a block in neither tier; once dropped here, DRAM's eviction writes it down
        again."""
        if self._hands_up is None or not keys:
            return False
        self._hands_up.hand_up(keys, session, depths)
        with self._lock:
            self._counts["moved_up"] += len(keys)
        return True

    def promoted(self, n: int) -> None:
        """The store copied ``n`` blocks this offloader's lower tier served into the top tier."""
        if n:
            with self._lock:
                self._counts["promoted"] += n

    def write_down(self, deadline: float, chunk: int = 256) -> tuple[int, int]:
        """The store is closing: write the top tier's blocks that this policy would write on their eviction and
        the lower tier lacks (with write_through: the ones whose copy was dropped), until ``deadline``
        (time.monotonic()) has passed. Returns (written, wanted): blocks the lower tier took, of those due."""
        top = self._top_slots
        if top is None:
            return 0, 0  # no slots to read in place (a node pool on top has no offloads anyway)
        keys = top.keys()
        want = [keys[i] for i in self.due_on_eviction(keys)] if keys else []
        with self._lock:
            self._counts["close_wanted"] += len(want)
        futures: list[Future[list[bytes]]] = []
        written_now = 0
        staging = self._staging
        for i in range(0, len(want), chunk):
            if time.monotonic() >= deadline:
                break
            part = want[i : i + chunk]
            with top.acquire(part) as addresses:  # read in place: nothing evicts or reuses them meanwhile
                there = [j for j, a in enumerate(addresses) if a is not None]
                rows = BlockRows(np.asarray([addresses[j] for j in there], np.uint64), (top,))
                part = [part[j] for j in there]
                if not part:
                    continue
                if staging is None:  # no write-behind: written now
                    stored = [k for k, h in zip(part, self.lower.put(part, rows)) if h]
                    self._written(stored)
                    written_now += len(stored)
                    continue
                future = staging.put_later(part, rows, wait=True)  # staged (copied) before it returns
            if future is None:
                break  # the lower tier stopped admitting (disk full or failing): its stats say why
            future.add_done_callback(lambda f: self._written(f.result() if not f.exception() else []))
            futures.append(future)
        self.flush(max(0.0, deadline - time.monotonic()))
        written = written_now + sum(len(f.result()) for f in futures if f.done() and not f.exception())
        return written, len(want)

    def _lower_holds(self, keys: Sequence[bytes]) -> list[bool]:
        # A remote tier answers from what it knows locally (sent or fetched recently), as on eviction.
        return self._remote.held_locally(keys) if self._remote is not None else self.lower.contains(keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload queued so far is written (or failed); False on timeout."""
        return True if self._staging is None else self._staging.flush(timeout)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"policy": self.policy.name, "promote": self.promote, **self._counts}

    # ---- internals ----------------------------------------------------------------------------------

    def _offload(self, keys: list[bytes], blocks: Any, *, wait: bool) -> None:
        with self._lock:
            self._counts["offered"] += len(keys)
        if self._staging is None:  # a lower tier without write-behind: write now (the top tier's lock is free)
            held = self.lower.put(keys, blocks)
            self._written([k for k, h in zip(keys, held) if h])
            return
        future: Future[list[bytes]] | None = self._staging.put_later(keys, blocks, wait=wait)
        if future is None:  # the lower tier does not admit (disk full or failing): its stats say why
            with self._lock:
                self._counts["refused"] += len(keys)
            return
        future.add_done_callback(lambda f: self._written(f.result() if not f.exception() else []))

    def _written(self, stored: list[bytes]) -> None:
        with self._lock:
            self._counts["written"] += len(stored)
        self._emit("stored", self.lower.name, stored)




def write_down(offloads: Sequence[Offloader], timeout_s: float, block_bytes: int) -> None:
    """A closing store's DRAM to its lower tiers (``Offloader.write_down``), all within ``timeout_s``; logs what
    was written, and what was not (lost with the process) when the bound passed or a tier refused."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    for offload in offloads:
        before = offload.stats()
        try:
            written, wanted = offload.write_down(deadline)
        except Exception:
            log.exception("close: writing DRAM's blocks to %s failed; they are lost with this process",
                          offload.lower.name)
            continue
        except BaseException as e:  # a signal handler's SystemExit or KeyboardInterrupt: said, then let through
            now = offload.stats()
            log.error("close: writing DRAM's blocks to %s was interrupted (%s) after %d of %d; the rest are lost "
                      "with this process", offload.lower.name, type(e).__name__,
                      now.get("written", 0) - before.get("written", 0),
                      now.get("close_wanted", 0) - before.get("close_wanted", 0))
            raise
        if not wanted:
            continue
        took = time.monotonic() - t0
        if written < wanted:
            log.warning("close: wrote %d of %d DRAM blocks (%s policy) to %s in %.2f s; the %d not written (the "
                        "%.3g s close_timeout_s passed, or the tier refused them) are lost with this process",
                        written, wanted, offload.policy, offload.lower.name, took, wanted - written, timeout_s)
        else:
            log.info("close: wrote %d DRAM blocks (%.1f MiB) to %s in %.2f s (%s policy, bound %.3g s)", written,
                     written * block_bytes / 2**20, offload.lower.name, took, offload.policy, timeout_s)
