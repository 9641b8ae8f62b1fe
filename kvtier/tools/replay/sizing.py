"""Sizing: bytes per block from a model's KV layout, and tier capacities in bytes or as a share of a workload.

A capacity is either bytes ("200GiB") or a percentage of the replayed traces' unique blocks ("25%"). Beware
the second with many traces: lanes replay a few conversations at a time, so a share of the whole set's blocks
is a far larger share of what is live at once. Compare policies on a fixed slice (the standard one: the first
60 agentic-cc traces by file name, 32 lanes) and say which.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from kvtier.layout import MODELS, BlockLayout
from kvtier.tools.replay.hybrid import HYBRID_MODELS, HybridModel
from kvtier.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class Capacity:
    """A tier size as given on the command line: ``fraction`` of the unique blocks, or ``nbytes``."""

    text: str
    fraction: float | None = None
    nbytes: int | None = None

    def blocks(self, unique_blocks: int, block_bytes: int) -> int:
        if self.fraction is not None:
            return int(self.fraction * unique_blocks)
        return (self.nbytes or 0) // block_bytes

    def nbytes_of(self, unique_blocks: int, block_bytes: int) -> int:
        """Bytes of this capacity when the workload's unique blocks are ``block_bytes`` each."""
        return self.blocks(unique_blocks, block_bytes) * block_bytes if self.fraction is not None else self.nbytes or 0

    def label(self, unique_blocks: int, block_bytes: int) -> str:
        n = self.blocks(unique_blocks, block_bytes)
        if n == 0:
            return "0 (none)"
        if self.fraction is not None:
            return f"{self.text} ({format_bytes(n * block_bytes)})"
        return format_bytes(self.nbytes or 0)


def parse_capacity(text: str) -> Capacity:
    """'25%' -> a share of the unique blocks; '200GiB' / '0' -> bytes. ValueError names the bad value."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise ValueError(f"not a capacity: {text!r} (examples: 25%, 200GiB, 0)") from None
        if not 0 <= pct <= 100:
            raise ValueError(f"capacity {text!r}: a percentage must be in 0..100")
        return Capacity(t, fraction=pct / 100)
    return Capacity(t, nbytes=parse_bytes(t))


def parse_capacities(text: str) -> list[Capacity]:
    """A comma-separated list: '2%,5%,10%' or '128GiB,256GiB'."""
    items = [parse_capacity(x) for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"no capacity in {text!r}")
    return items


class ModelSizing(NamedTuple):
    """What one trace block of a model is: its name, its layout (for a hybrid model the packed block holding
    every group whole) and, for a hybrid model, its groups' rules (hybrid.py)."""

    name: str
    layout: BlockLayout
    hybrid: HybridModel | None = None

    @property
    def share_bytes(self) -> int:
        """The bytes of one block a capacity's percentage counts: a whole block of a uniform model, the
        full-history groups' block of a hybrid one (its history; the state and window tails a store keeps are
        a small addition to it, and a store keeping every group whole holds that many bytes' worth of whole
        blocks: far fewer)."""
        return self.hybrid.full_block_bytes(self.layout.block_size) if self.hybrid is not None else self.layout.nbytes


def model_layout(
    model: str | None, block_tokens: int, *, layers: int | None = None, kv_heads: int | None = None,
    head_dim: int | None = None, dtype: str = "bfloat16", checkpoint_interval: int | None = None,
) -> ModelSizing:
    """One trace block of a known model by name (uniform or hybrid), or of explicit layers/heads/dim (MHA/GQA).
    ``checkpoint_interval``: a hybrid model's checkpoint interval in tokens (default: its preset's)."""
    explicit = (layers, kv_heads, head_dim)
    if any(v is not None for v in explicit):
        if model is not None:
            raise ValueError("give either --model or --layers/--kv-heads/--head-dim, not both")
        if any(v is None or v <= 0 for v in explicit):
            raise ValueError("an explicit model needs --layers, --kv-heads and --head-dim, all > 0")
        layout = BlockLayout.mha(layers, kv_heads, head_dim, dtype, block_size=block_tokens)  # type: ignore[arg-type]
        return ModelSizing(f"{layers}L x {kv_heads} KV heads x {head_dim} ({layout.groups[0].dtype})", layout)
    name = (model or "llama-3.1-8b").lower()
    hybrid = HYBRID_MODELS.get(name)
    if hybrid is not None:  # its preset fixes its dtypes (config.json's, or the engine's cache dtype)
        if checkpoint_interval is not None:
            if checkpoint_interval < 0 or checkpoint_interval % block_tokens:
                raise ValueError(f"checkpoint interval {checkpoint_interval}: a multiple of the block size "
                                 f"({block_tokens} tokens), or 0 for none")
            hybrid = replace(hybrid, interval_tokens=checkpoint_interval)
        return ModelSizing(name, hybrid.layout(block_tokens), hybrid)
    if checkpoint_interval is not None:
        raise ValueError(f"--checkpoint-interval is for a hybrid model ({', '.join(sorted(HYBRID_MODELS))})")
    if name not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}; hybrid: "
                         f"{', '.join(sorted(HYBRID_MODELS))} (or give --layers/--kv-heads/--head-dim)")
    return ModelSizing(name, BlockLayout.for_model(name, block_size=block_tokens, dtype=dtype))
