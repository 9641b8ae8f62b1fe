"""What the scheduler-side connector tells the worker-side connectors each step (vLLM pickles it to them).

Blocks are named by the engine's own block hashes, not kvtier keys: each worker folds them into its own
namespace (its TP rank, its layout), so the scheduler never needs to know how a rank's KV is laid out, and
one metadata object serves every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .hints import AgentHints, KvHintsNote
from .observe import RequestNotes


@dataclass(frozen=True)
class LoadPlan:
    """Load the blocks named by ``hashes`` into engine blocks ``block_ids`` (same order). ``lease`` is the
    lookup whose pins protect them; the worker releases it when the load ends. ``layerwise``: the load feeds
    this step's forward (wait_for_layer_load waits per layer); else it runs between steps and the worker
    reports the request in ``finished_recving`` when done."""

    req_id: str
    lease: int
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    layerwise: bool
    groups: tuple[int, ...] = ()  # each block's KV cache group (hybrid models); empty: all group 0

    def parts(self) -> list[tuple[int, tuple[bytes, ...], tuple[int, ...]]]:
        """(group, hashes, block ids) per group, in the order the groups first appear."""
        if not self.groups:
            return [(0, self.hashes, self.block_ids)]
        out: dict[int, tuple[list[bytes], list[int]]] = {}
        for g, h, b in zip(self.groups, self.hashes, self.block_ids):
            hs, bs = out.setdefault(g, ([], []))
            hs.append(h)
            bs.append(b)
        return [(g, tuple(hs), tuple(bs)) for g, (hs, bs) in out.items()]


@dataclass(frozen=True)
class SavePlan:
    """After this step's forward, store engine blocks ``block_ids`` under ``hashes`` (full blocks this step
    completed, not stored before)."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    hints: AgentHints | None = None
    group: int = 0  # the blocks' KV cache group
    sync: bool = False  # vLLM frees the blocks soon (a Mamba checkpoint): the step waits until they are read


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's work for every worker: loads, saves, lookup leases to release (the scheduler will not
    load them), requests preempted this step (their blocks are freed before they are overwritten), and what
    the scheduler saw of requests since the last step, for the stores' policies (``notes``), and the standard
    hint envelopes of the requests admitted since (``kv_hints``, applied after the notes: hints.py)."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    notes: RequestNotes = field(default_factory=RequestNotes)
    kv_hints: list[KvHintsNote] = field(default_factory=list)  # standard envelopes of requests admitted since

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.releases or self.preempted or self.notes or self.kv_hints)
