"""CostModel: for each candidate worker, what it costs to serve a prompt whose prefix blocks are ``keys``.

The router's real question is not "who holds the prefix" but "where is the next turn cheapest": a worker
holding 80% of the prefix on SSD may lose to one holding 60% in DRAM, and recomputing may beat fetching a
prefix from a slow node. Per candidate:

* each block of the cluster-wide prefix (the leading blocks some live node holds) comes from its fastest
  source: a local tier (bandwidth of that tier) or another node's tier (the slower of that tier and the
  network path), plus one RPC round trip for the remote fetches (they run in parallel);
* the plan loads the first m blocks and recomputes the rest; m is chosen to minimise
  load_s(m) + (prompt_tokens - m * block_tokens) / prefill_tokens_per_s.

Bandwidths are what the nodes measured (EWMAs in their heartbeats); where nothing is measured yet, the
configured defaults per tier name and per path apply. Vectorized over candidates: blocks with the same set of
holders are priced once (a prompt's blocks fall into a handful of such sets).

Runs in the master's event loop; pure computation over arrays it is handed; not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.master.nodes import Node, NodeRegistry

DEFAULT_TIER_BW = {"hbm": 1e12, "dram": 20e9, "pool": 10e9, "ssd": 3e9}


@dataclass
class CostDefaults:
    """Used where a node has not measured a bandwidth or latency yet (bytes/s, seconds)."""

    tier_bw: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_BW))
    other_tier_bw: float = 1e9  # a tier name not in ``tier_bw``
    path_bw: float = 10e9  # between two nodes (100 Gb/s)
    rpc_latency_s: float = 200e-6


@dataclass
class CostRequest:
    block_tokens: int
    prefill_tokens_per_s: float
    prompt_tokens: int  # >= len(keys) * block_tokens; the tokens past the last block are always recomputed


class CostModel:
    """Prices prompts for candidate workers from directory masks and the registry's measured signals."""

    def __init__(self, registry: NodeRegistry, defaults: CostDefaults) -> None:
        self.registry = registry
        self.defaults = defaults

    def _tier_bw(self, node: Node, tier: str) -> float:
        t = node.tiers.get(tier)
        if t is not None and t.bw > 0:
            return t.bw
        return self.defaults.tier_bw.get(tier, self.defaults.other_tier_bw)

    def _path_bw(self, src: Node, dst: str) -> float:
        dst_node = self.registry.nodes.get(dst)
        measured = (dst_node.path_bw.get(src.node_id, 0.0) if dst_node else 0.0) or src.path_bw.get(dst, 0.0)
        return measured if measured > 0 else self.defaults.path_bw

    def _latency(self, node: Node) -> float:
        return node.rpc_latency_s if node.rpc_latency_s > 0 else self.defaults.rpc_latency_s

    def plans(self, masks: np.ndarray, block_bytes: np.ndarray, prefix_len: int, candidates: list[str],
              req: CostRequest) -> list[dict[str, Any]]:
        """One plan per candidate. ``masks``: (n, words) live placements in prompt order; ``prefix_len``: the
        leading keys some live location holds; ``block_bytes``: per key."""
        n = prefix_len
        rate = req.prefill_tokens_per_s
        bt = req.block_tokens
        nc = len(candidates)
        # Locations holding any prefix block, and the distinct holder sets of the prefix blocks.
        bits = np.unpackbits(masks[:n].view(np.uint8), axis=1, bitorder="little")[:, : self.registry.location_count]
        used = np.flatnonzero(bits.any(axis=0)) if n else np.zeros(0, np.int64)
        bits = bits[:, used].astype(bool)
        if n:
            packed = np.packbits(bits, axis=1, bitorder="little")
            sets, inverse = np.unique(packed.view(np.dtype((np.void, packed.shape[1]))).ravel(), return_inverse=True)
            inverse = inverse.ravel()
            set_bits = np.unpackbits(sets.view(np.uint8).reshape(len(sets), -1), axis=1,
                                     bitorder="little")[:, : len(used)].astype(bool)
        else:
            inverse = np.zeros(0, np.int64)
            set_bits = np.zeros((0, 0), bool)
        owners = [self.registry.owner(int(loc)) for loc in used]
        # Bandwidth of each used location as seen from each candidate: (C, U).
        bw = np.zeros((nc, len(used)))
        remote = np.zeros((nc, len(used)), bool)
        for u, owner in enumerate(owners):
            if owner is None:
                continue
            src = self.registry.nodes[owner[0]]
            tier_bw = self._tier_bw(src, owner[1])
            for c, cand in enumerate(candidates):
                if cand == src.node_id:
                    bw[c, u] = tier_bw
                else:
                    bw[c, u] = min(tier_bw, self._path_bw(src, cand))
                    remote[c, u] = True
        # Best source per (candidate, holder set), then per block.
        eff = np.where(set_bits[None, :, :], bw[:, None, :], 0.0)  # (C, D, U)
        best_set = eff.argmax(axis=2) if len(used) else np.zeros((nc, len(set_bits)), np.int64)
        best_bw_set = np.take_along_axis(eff, best_set[:, :, None], axis=2)[:, :, 0] if len(used) else \
            np.zeros((nc, len(set_bits)))
        src = best_set[:, inverse]  # (C, n) index into ``used``
        seconds = block_bytes[None, :n] / np.maximum(best_bw_set[:, inverse], 1.0)
        is_remote = np.take_along_axis(remote, src, axis=1) if n else np.zeros((nc, 0), bool)
        for c in range(nc):  # one RPC round for the remote fetches, at the first remote block
            if n and is_remote[c].any():
                first = int(np.argmax(is_remote[c]))
                srcs = {owners[u][0] for u in np.unique(src[c][is_remote[c]]).tolist() if owners[u]}
                seconds[c, first] += max(self._latency(self.registry.nodes[s]) for s in srcs)
        load_cum = np.concatenate([np.zeros((nc, 1)), np.cumsum(seconds, axis=1)], axis=1)  # (C, n + 1)
        m = np.arange(n + 1)
        total = load_cum + (req.prompt_tokens - m * bt)[None, :] / rate
        choice = total.argmin(axis=1)
        held = bits.sum(axis=0)  # prefix blocks per used location
        out = []
        for c, cand in enumerate(candidates):
            k = int(choice[c])
            # What the worker holds (whatever the plan loads from): prefix tokens per local tier.
            mine = np.flatnonzero(~remote[c]) if len(used) else np.zeros(0, np.int64)
            local = {owners[u][1]: int(held[u]) * bt for u in mine.tolist() if owners[u] and held[u]}
            held_here = int(bits[:, mine].any(axis=1).sum()) if mine.size else 0
            # Where the cheapest plan loads each of its k blocks from.
            chosen = np.bincount(src[c][:k], minlength=len(used)) if k else np.zeros(len(used), np.int64)
            sources: dict[str, int] = {}
            for u in np.flatnonzero(chosen).tolist():
                owner = owners[u]
                if owner is not None:
                    name = f"{owner[0]}/{owner[1]}" if remote[c, u] else f"local/{owner[1]}"
                    sources[name] = sources.get(name, 0) + int(chosen[u])
            out.append({
                "worker": cand,
                "prefix_tokens": n * bt,
                "local_tokens": local,
                "remote_tokens": (n - held_here) * bt,
                "load_s": float(load_cum[c, n]),
                "recompute_s": n * bt / rate,
                "plan": {
                    "load_blocks": k,
                    "load_tokens": k * bt,
                    "recompute_tokens": req.prompt_tokens - k * bt,
                    "load_s": float(load_cum[c, k]),
                    "recompute_s": (req.prompt_tokens - k * bt) / rate,
                    "total_s": float(total[c, k]),
                    "sources": sources,
                },
            })
        return out
