"""The KV cache groups of a vLLM model as kvtier stores them: which kinds it can store, which blocks of each
group a hit at a block boundary needs, and which blocks are worth storing at all.

vLLM's hybrid KV cache manager gives each kind of layer its own group, block table and block lifetime
(``KVCacheConfig.kv_cache_groups``). kvtier stores one object per group per block, keyed by the engine's block
hash in a namespace of the model, the group's layout and the group index (worker.py): groups do not live and
die together (a sliding-window group's old blocks are dead while the full-attention group's are still hits),
so packing them into one object per block would store the dead ones too (docs/vllm.md "Hybrid models"; measured by
``bench/hybrid_bytes.py``).

Kinds kvtier stores:

* ``full``: full attention (MLA too). A hit at boundary ``b`` (in blocks, from the start of the lookup) needs
  every block before ``b``.
* ``sliding_window``: a hit at ``b`` needs the window before it, ``window_blocks`` blocks (vLLM's
  ``SlidingWindowManager._contiguous_blocks_for_hit``: ``cdiv(window - 1, block_size)``); vLLM allocates the
  null block for the older positions, so nothing else is loaded.

* ``mamba``: recurrent state (Mamba, GatedDeltaNet, ...) in vLLM's "align" mode: a hit at ``b`` needs the one
  state checkpointed at that boundary (block ``b - 1``); the state comes from the scheduler output's
  ``kv_connector_block_state.boundary_state_offloads`` (saves), and is loaded into the block vLLM allocates at
  ``b - 1``. KV without the matching state is never a hit.

Every other kind (chunked local attention, cross-attention, sink attention, ...) and draft-model
(EAGLE / MTP) groups are refused at start-up by ``describe_groups`` with an error naming the group, its kind and
what to do: kvtier never starts on a model it would serve state from another position, nor silently costs HBM.

Which blocks are stored (``save_mask``): a full-attention block of a single-group model always (any later
prompt may share any prefix). In a hybrid model only the hit points the engine itself restores from are
reachable (the end of each prompt, a prefix seen by a second request, every ``prefix_cache_retention_interval``
tokens): the sliding-window blocks inside the window of one of them (vLLM's own
``SlidingWindowManager.reachable_block_mask``), and full-attention blocks up to the deepest of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

FULL = "full"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"  # recurrent state (Mamba, GatedDeltaNet, ...) checkpointed by vLLM's "align" mode

# Exact spec types kvtier stores in a hybrid model (subclasses such as RSWASpec or SlidingWindowMLASpec change
# what a hit needs, so they are refused by name rather than treated as their parent).
_KINDS: dict[type, str] = {FullAttentionSpec: FULL, MLAAttentionSpec: FULL, SlidingWindowSpec: SLIDING_WINDOW,
                           MambaSpec: MAMBA}


class UnsupportedCacheGroup(ValueError):
    """A KV cache group kvtier cannot store (raised at start-up, before any request)."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as kvtier stores it. Immutable; the same on the scheduler and every worker."""

    index: int  # the group's index in vLLM's KVCacheConfig.kv_cache_groups (and in every block_ids tuple)
    kind: str  # FULL, SLIDING_WINDOW or MAMBA
    block_size: int  # tokens per block of this group
    layer_names: tuple[str, ...]
    mla: bool = False
    window: int = 0  # sliding window in tokens (0: full attention)
    spec: Any = None  # vLLM's KVCacheSpec of the group (for the engine's reachable_block_mask)
    # MAMBA: where each layer's state pages are in the worker's KV allocation: (layer, byte offset of block 0,
    # bytes between blocks, page bytes), from KVCacheConfig.kv_cache_tensors (empty on the scheduler).
    state_pages: tuple[tuple[str, int, int, int], ...] = ()

    @property
    def window_blocks(self) -> int:
        """Blocks before a hit boundary a hit needs (0: all of them)."""
        return cdiv(self.window - 1, self.block_size) if self.kind == SLIDING_WINDOW else 0

    def needed(self, start: int, boundary: int) -> range:
        """Blocks (absolute indices) a hit at block boundary ``boundary`` needs from the store, when the
        engine already holds ``[0, start)`` (its local prefix-cache hit, window included)."""
        if self.kind == SLIDING_WINDOW:
            return range(max(start, boundary - self.window_blocks), boundary)
        if self.kind == MAMBA:  # one state: the one checkpointed at the boundary, in the block that ends there
            return range(boundary - 1, boundary) if boundary > start else range(0)
        return range(start, boundary)


def _kind_name(spec: Any) -> str:
    return type(spec).__name__


def describe_groups(kv_cache_config: Any, *, speculative: bool = False) -> tuple[GroupSpec, ...]:
    """kvtier's view of ``kv_cache_config``'s groups; raises UnsupportedCacheGroup naming the first group it
    cannot store, its kind and what to do. A single attention group of any kind is stored whole, as before
    hybrid support (every block of it is a possible hit). ``speculative``: the engine runs a draft model."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        spec = groups[0].kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise UnsupportedCacheGroup(_refusal(0, spec))
        return (GroupSpec(0, FULL, int(spec.block_size), tuple(groups[0].layer_names),
                          mla=isinstance(spec, MLAAttentionSpec), spec=spec),)
    out = []
    # Groups outside transfer_group_ids are replicas vLLM rebuilds from their source group after a load.
    for i in kv_cache_config.transfer_group_ids:
        group = groups[i]
        spec = group.kv_cache_spec
        if group.is_eagle_group or speculative:
            raise UnsupportedCacheGroup(
                f"kvtier cannot store KV cache group {i} ({_kind_name(spec)}, layers {list(group.layer_names)[:3]}"
                "...): it belongs to a draft model (EAGLE / MTP speculative decoding), whose last block depends on "
                "tokens past its hash. Run this hybrid model without speculative decoding, or without kvtier")
        kind = _KINDS.get(type(spec))
        if kind is None:
            raise UnsupportedCacheGroup(_refusal(i, spec))
        if kind == MAMBA and spec.mamba_cache_mode != "align":
            raise UnsupportedCacheGroup(
                f"kvtier cannot store KV cache group {i} of kind MambaSpec in mamba_cache_mode "
                f"{spec.mamba_cache_mode!r}: kvtier stores the checkpoints of \"align\" mode only (a state at a block "
                "boundary, handed over by vLLM). Enable prefix caching (vLLM then picks align mode), or run this "
                "model without kvtier")
        out.append(GroupSpec(i, kind, int(spec.block_size), tuple(group.layer_names), mla=kind == FULL and
                             isinstance(spec, MLAAttentionSpec), window=window_of(spec), spec=spec,
                             state_pages=_state_pages(kv_cache_config, group) if kind == MAMBA else ()))
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise UnsupportedCacheGroup(
            f"kvtier stores hybrid models whose KV cache groups share one block size; this model's groups have "
            f"block sizes {[g.block_size for g in out]}. Set --block-size so every group uses the same one, or "
            "run without kvtier")
    return tuple(out)


def _state_pages(kv_cache_config: Any, group: Any) -> tuple[tuple[str, int, int, int], ...]:
    """(layer, offset of its block 0, block stride, page bytes) of each layer of a Mamba group, from the
    KVCacheTensors that place it (vLLM: block b of layer l starts at ``offset + l * layer_stride + b *
    block_stride`` of the tensor's allocation)."""
    out = []
    page = int(group.kv_cache_spec.page_size_bytes)
    for tensor in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(tensor.layers):
            if name in group.layer_names:
                out.append((name, int(tensor.offset) + i * int(tensor.layer_stride), int(tensor.block_stride), page))
    return tuple(out)


def window_of(spec: Any) -> int:
    """The sliding window of a SlidingWindowSpec (0 for full attention)."""
    return int(spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else 0


def _refusal(index: int, spec: Any) -> str:
    kind = _kind_name(spec)
    if isinstance(spec, MambaSpec):
        todo = ("kvtier stores recurrent state of the MambaSpec kind only, in a hybrid model (with attention "
                "groups); run this model without kvtier, or with vLLM's native offloading connector")
    else:
        todo = (f"kvtier stores full-attention and sliding-window KV only; run this model without kvtier, or "
                f"with --disable-hybrid-kv-cache-manager if vLLM can serve it as one {kind} group")
    return f"kvtier cannot store KV cache group {index} of kind {kind}: {todo}"


def is_hybrid(groups: Sequence[GroupSpec]) -> bool:
    return len(groups) > 1


def hit_boundaries(num_prompt_tokens: int, shared_prefix_boundary: int, num_tokens: int, block_size: int,
                   retention_interval: int | None) -> tuple[int, ...]:
    """Token positions the engine restores a hybrid model from (its ``reachable_boundaries``): the prompt's last
    token, where vLLM resumes a replayed prompt, and a prefix a second request shared (Marconi-style junction).
    ``retention_interval`` adds the engine's own periodic checkpoints (None: every block), up to ``num_tokens``."""
    points = [num_prompt_tokens - 1]
    if shared_prefix_boundary:
        points.append(shared_prefix_boundary)
    if retention_interval is None:
        retention_interval = block_size
    if retention_interval > 0:
        points += range(retention_interval, num_tokens, retention_interval)
    return tuple(p for p in points if p >= block_size)


def save_mask(group: GroupSpec, start: int, end: int, boundaries: Sequence[int], hybrid: bool) -> list[bool]:
    """Which of blocks ``[start, end)`` of ``group`` can serve a later hit, so are worth storing."""
    n = max(0, end - start)
    if not hybrid:
        return [True] * n
    if group.kind == MAMBA:
        # A Mamba block in the table holds the running state, not a checkpoint: checkpoints come only from
        # vLLM's boundary_state_offloads (scheduler.py), at the positions the engine restores from.
        return [False] * n
    if group.kind == SLIDING_WINDOW:
        mask = SlidingWindowManager.reachable_block_mask(
            start_block=start, end_block=end, alignment_tokens=group.block_size, kv_cache_spec=group.spec,
            use_eagle=False, retention_interval=0, reachable_boundaries=tuple(boundaries))
        return [True] * n if mask is None else list(mask)
    deepest = max((b // group.block_size for b in boundaries), default=0)
    return [start + i < deepest for i in range(n)]


def restorable(groups: Sequence[GroupSpec], present: Sequence[Sequence[bool]], start: int = 0) -> list[bool]:
    """``out[k]`` (k = 0 .. n-1): a hit at boundary ``start + k + 1`` can be restored, i.e. every group holds
    every block that hit needs. ``present[g][i]``: group g's block ``start + i`` is held. The one rule of a
    hybrid hit: full-attention blocks alone are not a hit when a window a group needs is missing."""
    n = len(present[0]) if present else 0
    out = [True] * n
    for group, have in zip(groups, present):
        if group.kind == SLIDING_WINDOW:
            # Missing blocks in the window of boundary b: a running count of misses over a sliding range.
            misses = [0]
            for h in have:
                misses.append(misses[-1] + (not h))
            w = group.window_blocks
            for k in range(n):
                b = k + 1
                if misses[b] - misses[max(0, b - w)]:
                    out[k] = False
        elif group.kind == MAMBA:  # the state checkpointed at the boundary, never one of another position
            for k in range(n):
                if not have[k]:
                    out[k] = False
        else:
            run = True
            for k in range(n):
                run = run and bool(have[k])
                if not run:
                    out[k] = False
    return out


def needed_blocks(groups: Sequence[GroupSpec], valid: Sequence[bool]) -> list[set[int]]:
    """Per group, the blocks (relative to the lookup's start) that some restorable boundary of ``valid``
    needs: what a worker pins for the scheduler, whichever of those boundaries every rank agrees on."""
    out: list[set[int]] = [set() for _ in groups]
    deepest = max((k + 1 for k, v in enumerate(valid) if v), default=0)
    for gi, group in enumerate(groups):
        if group.kind in (SLIDING_WINDOW, MAMBA):
            for k, v in enumerate(valid):
                if v:
                    out[gi].update(group.needed(0, k + 1))
        else:
            out[gi].update(range(deepest))
    return out
