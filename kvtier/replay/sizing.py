"""Sizing: bytes per block from a model's KV layout, and tier capacities in bytes or as a share of a workload.

A capacity is either bytes ("200GiB") or a percentage of the replayed traces' unique blocks ("25%"). Beware
the second with many traces: lanes replay a few conversations at a time, so a share of the whole set's blocks
is a far larger share of what is live at once. Compare policies on a fixed slice (the standard one: the first
60 agentic-cc traces by file name, 32 lanes) and say which.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.layout import MODELS, BlockLayout
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


def model_layout(
    model: str | None, block_tokens: int, *, layers: int | None = None, kv_heads: int | None = None,
    head_dim: int | None = None, dtype: str = "bfloat16",
) -> tuple[str, BlockLayout]:
    """(name, layout) of one trace block: a known model by name, or explicit layers/heads/dim (MHA/GQA)."""
    explicit = (layers, kv_heads, head_dim)
    if any(v is not None for v in explicit):
        if model is not None:
            raise ValueError("give either --model or --layers/--kv-heads/--head-dim, not both")
        if any(v is None or v <= 0 for v in explicit):
            raise ValueError("an explicit model needs --layers, --kv-heads and --head-dim, all > 0")
        layout = BlockLayout.mha(layers, kv_heads, head_dim, dtype, block_size=block_tokens)  # type: ignore[arg-type]
        return f"{layers}L x {kv_heads} KV heads x {head_dim} ({layout.groups[0].dtype})", layout
    name = (model or "llama-3.1-8b").lower()
    if name not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))} "
                         "(or give --layers/--kv-heads/--head-dim)")
    return name, BlockLayout.for_model(name, block_size=block_tokens, dtype=dtype)
