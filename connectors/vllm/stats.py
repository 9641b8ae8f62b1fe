"""KVTierConnectorStats: the connector's counters for one logging interval, as vLLM's stats plumbing wants them.

Workers report copy counters (their ``Transfers``) and the lookups they served; the scheduler reports the
lookups it made and their outcome. vLLM sums every worker's object with ``aggregate`` and logs ``reduce()``
("KV Transfer metrics: ..."). Plain dicts of numbers, so they pickle between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

GB = 1e9


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters summed over workers and steps: ``load_*`` / ``save_*`` (blocks, bytes, seconds on the copy
    threads), ``lookup_*`` (scheduler: lookups, blocks found, seconds waited; worker: lookups served),
    ``stalled_waits`` (worker: load_timeout_s periods the engine thread waited on a stuck copy thread)."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, counters: dict[str, float]) -> None:
        for k, v in counters.items():
            if v:
                self.data[k] = self.data.get(k, 0) + v

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        out = KVTierConnectorStats(dict(self.data))
        out.add(other.data)
        return out

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(d.items())}
        for op in ("load", "save"):
            seconds = d.get(f"{op}_seconds", 0.0)
            if seconds > 0:
                out[f"{op}_GBps"] = round(d.get(f"{op}_bytes", 0) / seconds / GB, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data
