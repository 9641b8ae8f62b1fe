"""vLLM's per-worker rank directories: each vLLM worker process owns its store, so a path the store opens as
its own gets ``<model dir>/<rank dir>`` (kvtier.connectors.paths, shared with the SGLang connector):

    <ssd_path>/<model dir>/<rank dir>/        e.g. /nvme/kvtier/Llama-3.1-8B-5d41402a/tp1of4/

``<rank dir>``: ``tp{r}of{n}``, then ``-pcp{r}of{n}`` and ``-pp{r}of{n}`` when those are > 1, then ``-dp{r}``
when data parallelism is on. Pure functions; no vLLM import.
"""

from __future__ import annotations

from kvtier.connectors.paths import PER_WORKER_KEYS, model_dir, per_worker

__all__ = ["PER_WORKER_KEYS", "model_dir", "per_worker", "rank_dir"]


def rank_dir(rank: int, *, tp: int, pcp: int = 1, pp: int = 1, dp_rank: int = 0, dp_size: int = 1) -> str:
    """The directory name of the worker of engine-local ``rank`` (vLLM orders ranks PP, PCP, TP, TP innermost)."""
    if not 0 <= rank < tp * pcp * pp:
        raise ValueError(f"rank {rank} is outside tp {tp} x pcp {pcp} x pp {pp}")
    name = f"tp{rank % tp}of{tp}"
    if pcp > 1:
        name += f"-pcp{rank // tp % pcp}of{pcp}"
    if pp > 1:
        name += f"-pp{rank // (tp * pcp)}of{pp}"
    if dp_size > 1:
        name += f"-dp{dp_rank}"
    return name
