"""Prefetch between turns: bring an idle agent's prefix up into the top tier (DRAM) before it comes back.

* ``prefetcher.py``  Prefetcher: the jobs, their order, their bounds and counts (the module docstring tells how).
* ``jobs.py``        Job, one agent's prefix to bring up; ParkedJobs, the chains up, watched until their agent is back.
* ``driver.py``      PrefetchDriver (moves it on a thread in a server) and PrefetchCollector (Prometheus).
"""

from kvtier.prefetch.driver import PrefetchCollector, PrefetchDriver
from kvtier.prefetch.prefetcher import COUNTS, PrefetchCounts, Prefetcher

__all__ = ["COUNTS", "PrefetchCollector", "PrefetchCounts", "PrefetchDriver", "Prefetcher"]
