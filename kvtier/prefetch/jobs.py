"""A Prefetcher's jobs (kvtier/prefetch/prefetcher.py): ``Job``, one idle agent's prefix to bring up, and
``ParkedJobs``, the jobs whose chain is up, watched until their agent is back."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(eq=False)  # a job is itself (ParkedJobs' index holds jobs in sets): compared and hashed by identity
class Job:
    """One agent's prefix to bring up: ``chain`` root first, ``pos`` how far along it is."""

    session: str
    chain: list[bytes]
    pos: int = 0
    explicit: bool = False  # asked for (``request``), not inferred from an idle agent
    watched: int = 0  # while parked: how many of the chain's leading keys are watched (ParkedJobs)


class ParkedJobs:
    """Parked jobs (their chains up), oldest first, and an index from each watched key to its jobs, so the jobs an
    eviction touches are one lookup per evicted key: a scan of every parked chain took 0.46 ms per 16-key eviction
    at 1,024 chains, on the evicting thread. A key in several chains (a shared system prompt, a parent's prefix)
    names each of them.

    Taking a job out (``pop``, ``touched``: on the evicting thread) is O(1): its keys leave the index at the next
    ``park`` (the prefetch step's), and until then a lookup skips them (their job is no longer parked). So the index
    holds at most the keys parked before the last ``park``, within its bound. Under the Prefetcher's lock."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self._index: dict[bytes, Job | set[Job]] = {}
        self._keys = 0  # keys watched by the parked jobs
        self._gone: list[Job] = []  # taken out, their keys still in the index

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def park(self, job: Job, max_jobs: int, max_keys: int) -> None:
        """Watch ``job``'s chain up to ``job.pos``; the oldest parked go while more than the bounds are held."""
        self.pop(job.session)
        self._forget_gone()
        job.watched = job.pos
        self.jobs[job.session] = job
        self._keys += job.watched
        index = self._index
        for k in job.chain[: job.watched]:
            held = index.setdefault(k, job)
            if held is not job:
                if isinstance(held, set):
                    held.add(job)
                else:
                    index[k] = {held, job}
        while len(self.jobs) > max_jobs or self._keys > max_keys:
            self.pop(next(iter(self.jobs)))
        self._forget_gone()

    def pop(self, session: str) -> Job | None:
        """Stop watching ``session``'s chain; its job, if it was parked."""
        job = self.jobs.pop(session, None)
        if job is not None:
            self._keys -= job.watched
            self._gone.append(job)
        return job

    def touched(self, keys: Sequence[bytes]) -> list[Job]:
        """Stop watching the chains that hold any of ``keys``; their jobs, oldest parked first."""
        hit: set[Job] = set()
        for k in keys:
            held = self._index.get(k)
            if held is not None:
                hit.update(held if isinstance(held, set) else (held,))
        live = [job for job in self.jobs.values() if job in hit] if hit else []
        for job in live:
            self.pop(job.session)
        return live

    def _forget_gone(self) -> None:
        index = self._index
        for job in self._gone:
            for k in job.chain[: job.watched]:
                held = index.get(k)
                if held is job:
                    del index[k]
                elif isinstance(held, set):
                    held.discard(job)
                    if len(held) == 1:
                        index[k] = held.pop()
            job.watched = 0
        self._gone.clear()
