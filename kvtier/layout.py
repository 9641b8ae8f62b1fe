"""BlockLayout: what one packed block holds and where.

A packed block is one contiguous buffer holding every layer of every cache group for one block of tokens:
full-attention K/V, MLA latents, sliding-window K/V, recurrent state. Each (group, layer, part) is a
*region* at a fixed byte offset, so a block moves between tiers as one buffer and the kernels in native/
know exactly where each engine fragment goes.

The fingerprint is a stable hash of the description (not of Python object ids): it goes into the key
namespace, so blocks packed with different layouts never mix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Element sizes of the dtypes engines keep KV in. fp8 KV is moved as bytes.
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int8": 1, "uint8": 1,
}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

GROUP_KINDS = ("attention", "mla", "sliding_window", "recurrent")
LAYOUT_VERSION = 1


def canonical_dtype(dtype: object) -> str:
    """'bf16', torch.bfloat16 and 'bfloat16' all -> 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return name


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group: ``num_layers`` layers, each holding the same named parts per block.

    ``parts`` lists (name, shape) for one layer of one block, e.g. ``(("k", (16, 8, 128)), ("v", ...))``.
    """

    name: str
    kind: str
    num_layers: int
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"cache group {self.name!r}: unknown kind {self.kind!r}; known: {GROUP_KINDS}")
        if self.num_layers <= 0:
            raise ValueError(f"cache group {self.name!r}: num_layers must be > 0, got {self.num_layers}")
        if not self.parts:
            raise ValueError(f"cache group {self.name!r} has no parts")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        parts = tuple((str(n), tuple(int(d) for d in shape)) for n, shape in self.parts)
        for n, shape in parts:
            if not shape or any(d <= 0 for d in shape):
                raise ValueError(f"cache group {self.name!r} part {n!r}: bad shape {shape}")
        object.__setattr__(self, "parts", parts)

    @property
    def layer_bytes(self) -> int:
        return sum(math.prod(shape) for _, shape in self.parts) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Region:
    """One contiguous run inside a packed block."""

    group: str
    layer: int
    part: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class BlockLayout:
    """The byte layout of one packed block: regions in (group, layer, part) order, each ``align``-aligned.

    Regions start at multiples of ``align`` (16 by default, so the kernels' 16-byte vector copies need no
    scalar head); the block's total size ``nbytes`` is rounded up to ``align`` too.
    """

    block_size: int
    groups: tuple[CacheGroup, ...]
    align: int = 16
    regions: tuple[Region, ...] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.align <= 0 or self.align & (self.align - 1):
            raise ValueError(f"align must be a power of two, got {self.align}")
        groups = tuple(self.groups)
        if not groups:
            raise ValueError("a BlockLayout needs at least one cache group")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"cache group names must be unique, got {names}")
        object.__setattr__(self, "groups", groups)
        regions, offset = [], 0
        for g in groups:
            esize = DTYPE_BYTES[g.dtype]
            for layer in range(g.num_layers):
                for part, shape in g.parts:
                    nbytes = math.prod(shape) * esize
                    regions.append(Region(g.name, layer, part, offset, nbytes, shape, g.dtype))
                    offset = _round_up(offset + nbytes, self.align)
        object.__setattr__(self, "regions", tuple(regions))
        object.__setattr__(self, "nbytes", offset)

    # ---- constructors for the common shapes -------------------------------------------------------------

    @classmethod
    def mha(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: object = "bfloat16",
        block_size: int = 16, kv_fused: bool = False, kind: str = "attention",
    ) -> BlockLayout:
        """Full attention (MHA/GQA). Per layer either separate ``k`` and ``v`` parts of shape
        (block_size, num_kv_heads, head_dim), or with ``kv_fused`` one ``kv`` part of shape
        (block_size, num_kv_heads, 2 * head_dim), which is how vLLM >= 0.33 keeps K and V side by side."""
        tokens_heads = (block_size, num_kv_heads)
        parts = ((("kv", (*tokens_heads, 2 * head_dim)),) if kv_fused
                 else (("k", (*tokens_heads, head_dim)), ("v", (*tokens_heads, head_dim))))
        return cls(block_size, (CacheGroup(kind, kind, num_layers, parts, canonical_dtype(dtype)),))

    @classmethod
    def mla(
        cls, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: object = "bfloat16", block_size: int = 64,
    ) -> BlockLayout:
        """Multi-head latent attention (DeepSeek): one latent of kv_lora_rank + rope_dim per token."""
        parts = (("latent", (block_size, kv_lora_rank + rope_dim)),)
        return cls(block_size, (CacheGroup("mla", "mla", num_layers, parts, canonical_dtype(dtype)),))

    @classmethod
    def hybrid(cls, block_size: int, groups: Sequence[CacheGroup], align: int = 16) -> BlockLayout:
        """Several cache groups in one block (e.g. full attention + sliding window + recurrent state)."""
        return cls(block_size, tuple(groups), align)

    @classmethod
    def for_model(cls, name: str, block_size: int = 16, dtype: object = "bfloat16") -> BlockLayout:
        """Layout of a known model by name (see MODELS), e.g. ``for_model("llama-3.1-8b", 64)``."""
        try:
            spec = MODELS[name.lower()]
        except KeyError:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
        if "kv_lora_rank" in spec:
            return cls.mla(spec["num_layers"], spec["kv_lora_rank"], spec["rope_dim"], dtype, block_size)
        return cls.mha(spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], dtype, block_size)

    # ---- queries ---------------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """16 hex digits, stable across processes, machines and Python versions."""
        desc = {
            "v": LAYOUT_VERSION, "block_size": self.block_size, "align": self.align,
            "groups": [[g.name, g.kind, g.num_layers, g.dtype, [[n, list(s)] for n, s in g.parts]]
                       for g in self.groups],
        }
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / self.block_size

    def region(self, group: str, layer: int, part: str) -> Region:
        for r in self.regions:
            if r.group == group and r.layer == layer and r.part == part:
                return r
        raise KeyError(f"no region ({group!r}, layer {layer}, {part!r}) in this layout")

    def view(self, block: "object", region: Region) -> "object":
        """A typed, shaped view of ``region`` inside one packed block (a 1-D uint8 torch tensor)."""
        import torch

        raw = block[region.offset : region.offset + region.nbytes]  # type: ignore[index]
        return raw.view(getattr(torch, region.dtype)).view(region.shape)

    def describe(self) -> str:
        groups = ", ".join(f"{g.name}: {g.num_layers} layers x {g.layer_bytes} B ({g.dtype})" for g in self.groups)
        return f"BlockLayout({self.block_size} tokens, {self.nbytes} B/block; {groups}; fp {self.fingerprint})"


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


# Models the CLI and the replay tool know by name. num_kv_heads is the total across TP ranks.
MODELS: dict[str, dict[str, int]] = {
    "llama-3.1-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "llama-3.1-70b": {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
    "llama-3.1-405b": {"num_layers": 126, "num_kv_heads": 8, "head_dim": 128},
    "qwen3-8b": {"num_layers": 36, "num_kv_heads": 8, "head_dim": 128},
    "qwen3-32b": {"num_layers": 64, "num_kv_heads": 8, "head_dim": 128},
    "qwen3-235b-a22b": {"num_layers": 94, "num_kv_heads": 4, "head_dim": 128},
    "deepseek-v3": {"num_layers": 61, "kv_lora_rank": 512, "rope_dim": 64},
    "kimi-k2": {"num_layers": 61, "kv_lora_rank": 512, "rope_dim": 64},
}
