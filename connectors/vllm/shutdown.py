"""How long a vLLM worker's store may spend writing DRAM down on shutdown (TieredStore.close).

vLLM's executor gives its workers VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s by default) to exit, then sends
SIGTERM and, 4 s later, SIGKILL: a write-down still running then is cut short with nothing logged. So the
worker bounds it by the smaller of ``close_timeout_s`` and that grace minus a second for the rest of the
shutdown, and says so when it cuts the configured bound (raise VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS to give
the SSD more time).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SIGTERM_TO_SIGKILL_S = 4.0  # vLLM's executor: SIGKILL this long after the SIGTERM that follows the grace period


def close_timeout(configured: float) -> float:
    """The write-down bound for a worker whose store config says ``configured`` seconds."""
    try:
        grace = float(os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5"))
    except ValueError:
        grace = 5.0
    budget = max(0.0, grace + SIGTERM_TO_SIGKILL_S - 1.0)
    if configured > budget:
        log.info("kvtier: DRAM write-down on shutdown bounded to %.3g s (close_timeout_s %.3g s, but vLLM kills "
                 "workers %.3g s after asking them to stop; raise VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for more)",
                 budget, configured, grace + SIGTERM_TO_SIGKILL_S)
        return budget
    return configured
