"""CostModel: for each candidate worker, what it costs to serve a prompt whose prefix blocks are ``keys``.

The router's real question is not "who holds the prefix" but "where is the next turn cheapest": a worker
holding 80% of the prefix on SSD may lose to one holding 60% in DRAM, and recomputing may beat fetching a
prefix from a slow node. Per candidate:

* each block of the cluster-wide prefix (the leading blocks some live node holds) comes from its fastest
  source: a local tier (bandwidth of that tier) or another node's tier (the slower of that tier and the
  network path), plus one RPC round trip for the remote fetches (they run in parallel);
* the plan loads the first m blocks and recomputes the rest; m is chosen to minimise
  load_s(m) + (prompt_tokens - m * block_tokens) / prefill_tokens_per_s.

A hybrid model's prompt (sliding-window or recurrent cache groups besides full attention) can be restored only
at a boundary where every group can: the full-history blocks before it, plus the objects restoring there needs
(its recurrent state checkpoint, its window groups' tail blocks). The caller names those boundaries and their
objects' keys (``RestorePoints``); a plan then cuts only at 0 or at one of them whose objects some live node
holds, and pays the full-history blocks before the cut plus that boundary's objects, at the bytes the
directory recorded for each. A prefix whose state is held nowhere is no restore point: it is priced as
recomputed.

Bandwidths are what the nodes measured (EWMAs in their heartbeats); where nothing is measured yet, the
configured defaults per tier name and per path apply. Vectorized over candidates: blocks with the same set of
holders are priced once (a prompt's blocks fall into a handful of such sets).

Runs in the master's event loop; pure computation over arrays it is handed; not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.master.directory import mask_locations
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


@dataclass
class RestorePoints:
    """A hybrid prompt's restore points: ``at`` (K,) boundaries in blocks, ascending, each within the prefix
    whose full-history blocks are held and each with all its objects held; object ``i`` belongs to boundary
    ``owner[i]`` (an index into ``at``) and has live placements ``masks[i]`` and ``nbytes[i]`` bytes."""

    at: np.ndarray
    owner: np.ndarray
    masks: np.ndarray
    nbytes: np.ndarray


class CostModel:
    """Prices prompts for candidate workers from directory masks and the registry's measured signals."""

    def __init__(self, registry: NodeRegistry, defaults: CostDefaults) -> None:
        self.registry = registry
        self.defaults = defaults

    def tier_bw(self, node: Node, tier: str) -> float:
        """Bytes/s out of ``tier`` of ``node``: its measured EWMA (lower when the node is loaded), else the default."""
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
              req: CostRequest, restore: RestorePoints | None = None) -> list[dict[str, Any]]:
        """One plan per candidate. ``masks``: (n, words) live placements in prompt order; ``prefix_len``: the
        leading keys some live location holds (a hybrid prompt: its deepest restore point); ``block_bytes``: per
        key; ``restore``: a hybrid prompt's restore points (None: any cut restores)."""
        n, bt, rate, nc = prefix_len, req.block_tokens, req.prefill_tokens_per_s, len(candidates)
        if restore is not None and n == 0:
            restore = None  # no restore point is held: the whole prompt is recomputed
        if restore is not None and (not len(restore.at) or int(restore.at[-1]) != n):
            raise ValueError(f"a hybrid prompt's prefix ({n} blocks) must be its deepest restore point")
        extra = restore.masks if restore is not None else None
        hs = _HolderSets(masks[:n], restore.at if restore is not None else None, extra)
        owners = [self.registry.owner(loc) for loc in hs.used]
        nodes = [self.registry.nodes[o[0]] if o else None for o in owners]
        nu, nd = len(hs.used), len(hs.count)
        # Per candidate and location (C, U): local or remote, and the bandwidth of reading a block from it.
        local = np.array([[o is not None and o[0] == c for o in owners] for c in candidates], bool).reshape(nc, nu)
        # (Live bits always have an owner; an unowned one would be priced as unreachable: bandwidth 0.)
        tier_bw = np.array([self.tier_bw(nd_, o[1]) if o and nd_ else 0.0 for o, nd_ in zip(owners, nodes)])
        latency = np.array([self._latency(nd_) if nd_ else 0.0 for nd_ in nodes])
        path = np.full((nc, nu), self.defaults.path_bw)
        if any(n_.path_bw for n_ in self.registry.nodes.values()):  # measured paths: look each pair up
            for u, nd_ in enumerate(nodes):
                for c, name in enumerate(candidates):
                    if nd_ is not None and not local[c, u]:
                        path[c, u] = self._path_bw(nd_, name)
        bw = np.where(local, tier_bw[None, :], np.minimum(tier_bw[None, :], path))
        # Each holder set's best source per candidate (C, D).
        eff = np.where(hs.sets[None, :, :], bw[:, None, :], 0.0)
        best = eff.argmax(axis=2) if nu else np.zeros((nc, nd), np.int64)
        inv_bw = 1.0 / np.maximum(eff.max(axis=2) if nu else np.ones((nc, nd)), 1.0)
        rows = np.arange(nc)[:, None]
        remote_set = ~local[rows, best] if nu else np.zeros((nc, nd), bool)
        # Loading the first m blocks costs sum_d bytes_d(m) / bw[c, d], plus one RPC round (remote fetches run
        # in parallel: the slowest source) once a remote block is in. Within a run of blocks of one holder set
        # the cost grows linearly, so the best cut is at a run boundary: only those cuts are priced.
        cuts = hs.boundaries
        bytes_at = _running(hs, np.add.reduceat(block_bytes[:n].astype(np.float64), hs.starts) if n else [])
        load = bytes_at @ inv_bw.T  # (B, C)
        used_src = np.zeros((nc, max(nu, 1)), bool)
        used_src[rows, best] = True
        rpc = np.where(used_src[:, :nu] & ~local, latency[None, :], 0.0).max(axis=1) if nu else np.zeros(nc)
        first_remote = np.where(remote_set, hs.first[None, :], n).min(axis=1) if nd else np.full(nc, n)
        load += (cuts[:, None] > first_remote[None, :]) * rpc[None, :]
        load_bytes = np.repeat(bytes_at.sum(axis=1)[:, None], nc, axis=1)  # (B, C) full-history bytes loaded
        extra_per_source = None
        if restore is not None:  # a hybrid prompt: cut only at 0 or a restore point, and pay its objects there
            load, load_bytes, extra_per_source = self._restore_costs(hs, restore, load, load_bytes, inv_bw, best,
                                                                     remote_set, rpc, first_remote)
        total = load + ((req.prompt_tokens - cuts * bt) / rate)[:, None]
        choice = total.argmin(axis=0)  # (C,) index into cuts
        k = cuts[choice]
        # Blocks loaded per source in each chosen plan.
        per_set = _running(hs, hs.run_len)[choice].astype(np.int64)  # (C, D)
        per_source = np.zeros((nc, max(nu, 1)), np.int64)
        np.add.at(per_source, (np.broadcast_to(rows, best.shape), best), per_set)
        if extra_per_source is not None:  # the chosen restore point's objects, by the source each comes from
            per_source += extra_per_source(choice)
        held_per_loc = (hs.count @ hs.sets).tolist() if nu else []
        held_here = ((hs.sets[None, :, :] & local[:, None, :]).any(axis=2) * hs.count[None, :]).sum(axis=1)
        cols = np.arange(nc)
        load_all, plan_load, plan_total = load[-1].tolist(), load[choice, cols].tolist(), total[choice, cols].tolist()
        plan_bytes = load_bytes[choice, cols].tolist()
        local_l, per_source_l, k_l, held_here_l = local.tolist(), per_source.tolist(), k.tolist(), held_here.tolist()
        out = []
        for c, name in enumerate(candidates):
            local_tokens: dict[str, int] = {}
            sources: dict[str, int] = {}
            for u, (owner, is_local) in enumerate(zip(owners, local_l[c])):
                if owner is None:
                    continue
                if is_local and held_per_loc[u]:
                    local_tokens[owner[1]] = local_tokens.get(owner[1], 0) + int(held_per_loc[u]) * bt
                if per_source_l[c][u]:
                    label = f"local/{owner[1]}" if is_local else f"{owner[0]}/{owner[1]}"
                    sources[label] = sources.get(label, 0) + per_source_l[c][u]
            kc = k_l[c]
            out.append({
                "worker": name,
                "prefix_tokens": n * bt,
                "local_tokens": local_tokens,
                "remote_tokens": (n - int(held_here_l[c])) * bt,
                "load_s": load_all[c] if n else 0.0,
                "recompute_s": n * bt / rate,
                "plan": {
                    "load_blocks": kc,
                    "load_tokens": kc * bt,
                    "recompute_tokens": req.prompt_tokens - kc * bt,
                    "load_s": plan_load[c],
                    "load_bytes": int(plan_bytes[c]),
                    "recompute_s": (req.prompt_tokens - kc * bt) / rate,
                    "total_s": plan_total[c],
                    "sources": sources,
                },
            })
        return out


    @staticmethod
    def _restore_costs(hs: _HolderSets, restore: RestorePoints, load: np.ndarray, load_bytes: np.ndarray,
                       inv_bw: np.ndarray, best: np.ndarray, remote_set: np.ndarray, rpc: np.ndarray,
                       first_remote: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        """``load`` and ``load_bytes`` (B, C) with each restore point's objects added at its cut and every
        other cut but 0 made impossible (infinite), and a function giving the objects' loads per source for
        chosen cuts."""
        cuts, nc = hs.boundaries, load.shape[1]
        row = np.searchsorted(cuts, restore.at)  # the cut of each restore point
        owner_row = row[restore.owner]  # (k,) each object's cut
        sets = hs.extra_set  # (k,) each object's holder set
        obj_s = restore.nbytes[:, None] * inv_bw[:, sets].T  # (k, C) seconds to load each object
        extra = np.zeros_like(load)
        np.add.at(extra, owner_row, obj_s)
        remote = np.zeros(load.shape, bool)  # a cut whose objects come from another node pays one RPC round
        np.logical_or.at(remote, owner_row, remote_set[:, sets].T)
        full_remote = cuts[:, None] > first_remote[None, :]
        allowed = np.zeros(len(cuts), bool)
        allowed[0] = True
        allowed[row] = True
        out = np.where(allowed[:, None], load + extra + (remote & ~full_remote) * rpc[None, :], np.inf)
        out_bytes = load_bytes.copy()
        np.add.at(out_bytes, owner_row, restore.nbytes[:, None].astype(load_bytes.dtype))

        def per_source(choice: np.ndarray) -> np.ndarray:
            counts = np.zeros((nc, max(len(hs.used), 1)), np.int64)
            for c in range(nc):
                mine = owner_row == choice[c]
                np.add.at(counts[c], best[c, sets[mine]], 1)
            return counts

        return out, out_bytes, per_source


class _HolderSets:
    """The distinct placement masks among a prompt's prefix blocks, and the runs of consecutive blocks with
    the same mask. A prompt's blocks fall in a handful of such sets and runs, so the per-candidate work runs on
    (C, D, U) and (runs, C) arrays instead of (C, n, U).

    ``sets`` (D, U) bool over ``used`` (the locations holding any block); ``first``/``count`` (D,) each set's
    first block and block count; ``starts``/``run_len``/``run_set`` (R,) the runs; ``boundaries`` (R + 1,)
    the cuts between runs, 0 and n included. ``split_at``: more cuts (a hybrid prompt's restore points), runs
    end there too. ``extra`` (k, words): masks of other keys priced with the prompt (a restore point's objects):
    their sets are numbered with the prompt's (``extra_set``, (k,)); a set only they have starts at n."""

    def __init__(self, masks: np.ndarray, split_at: np.ndarray | None = None, extra: np.ndarray | None = None) -> None:
        n, words = masks.shape
        if n == 0:
            self.used: list[int] = []
            self.sets = np.zeros((0, 0), bool)
            self.first = self.count = self.starts = self.run_len = self.run_set = np.zeros(0, np.int64)
            self.boundaries = np.zeros(1, np.int64)
            self.extra_set = np.zeros(0, np.int64)
            return
        differs = masks[1:, 0] != masks[:-1, 0]
        for w in range(1, words):
            differs |= masks[1:, w] != masks[:-1, w]
        change = np.flatnonzero(differs) + 1
        if split_at is not None:
            change = np.union1d(change, split_at[(split_at > 0) & (split_at < n)])
        self.starts = np.concatenate([[0], change]).astype(np.int64)
        self.boundaries = np.concatenate([self.starts, [n]]).astype(np.int64)
        self.run_len = np.diff(self.boundaries)
        run_masks = masks[self.starts]
        # Number the distinct masks in order of first appearance (runs are few: a dict beats np.unique here).
        index: dict[tuple[int, ...], int] = {}
        run_set, first_run = [], []
        for r, row in enumerate(run_masks.tolist()):
            key = tuple(row)
            d = index.get(key)
            if d is None:
                d = index[key] = len(index)
                first_run.append(r)
            run_set.append(d)
        extra_set = []
        for row in (extra.tolist() if extra is not None else []):
            extra_set.append(index.setdefault(tuple(row), len(index)))
        self.extra_set = np.array(extra_set, np.int64)
        uniq = np.array(list(index), np.uint64).reshape(len(index), words)
        self.run_set = np.array(run_set, np.int64)
        self.first = np.concatenate([self.starts[first_run], np.full(len(index) - len(first_run), n)]).astype(np.int64)
        self.count = np.bincount(self.run_set, weights=self.run_len, minlength=len(uniq)).astype(np.int64)
        self.used = mask_locations(np.bitwise_or.reduce(uniq, axis=0))
        used = np.array(self.used, np.int64)
        self.sets = ((uniq[:, used // 64] >> (used % 64).astype(np.uint64)) & np.uint64(1)).astype(bool)


def _running(hs: _HolderSets, per_run: np.ndarray | list[float]) -> np.ndarray:
    """(R + 1, D): the sum of ``per_run`` over the runs of each set before each boundary."""
    steps = np.zeros((len(hs.starts) + 1, len(hs.count)))
    steps[np.arange(1, len(hs.starts) + 1), hs.run_set] = per_run
    return np.cumsum(steps, axis=0)
