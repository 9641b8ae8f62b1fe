"""Hybrid models for the replay: what each cache group of a model costs, and when a prefix can be restored.

A hybrid model's cache groups live by different rules (docs/vllm.md "Hybrid models (several KV cache groups)"):

* full-history groups (full attention, MLA, DeepSeek V4's compressed attention and indexer) keep every token:
  a prefix of d blocks needs all d of their blocks;
* sliding-window groups keep the last ``window`` tokens: restoring at boundary d needs the group's blocks that
  cover the ``window - 1`` tokens before d (``cdiv(window - 1, block_tokens)`` blocks, as vLLM's
  SlidingWindowManager counts them), and nothing older;
* recurrent groups (GatedDeltaNet, Mamba) keep one fixed-size state per sequence: restoring at d needs the
  state checkpointed at exactly d, and the engine keeps state only at its checkpoints (align mode).

So a hybrid hit at boundary d (``restorable_depth``) needs every full-history block before d, each window
group's tail before d, and the state at d (``boundary_objects``). Checkpoints (``checkpoints``) are where the
engine keeps state and window tails: the end of each request's prompt (its last full block), a fork junction (the depth at which a
request leaves every prefix seen before: the second sighting of that prefix, where subagents fork off a shared
context), and, with ``interval_tokens``, every so many tokens (vLLM's ``prefix_cache_retention_interval``; 0,
vLLM's default, keeps the semantic checkpoints only). Storing "only what can be used" stores the full-history
blocks, the state at each checkpoint and each window group's tail before it; storing "every group whole"
stores every group of every block (one packed block: ``HybridModel.layout``).

This is a description of a model's group structure, not of any connector's storage format: the vLLM and SGLang
connectors choose their own keys and object granularity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvtier.layout import BlockLayout, CacheGroup


@dataclass(frozen=True)
class WindowGroup:
    """A sliding-window cache group: ``bytes_per_token`` over all its layers, attending ``window`` tokens."""

    name: str
    bytes_per_token: float
    window: int

    def __post_init__(self) -> None:
        if not self.bytes_per_token > 0 or self.window < 1:
            raise ValueError(f"window group {self.name!r}: bytes per token and window must be > 0")

    def tail_blocks(self, block_tokens: int) -> int:
        """Blocks before a boundary that restoring at it needs: those covering the ``window - 1`` tokens the
        next token attends to besides itself."""
        return -(-(self.window - 1) // block_tokens)


@dataclass(frozen=True)
class HybridModel:
    """A hybrid model's cache groups as the replay prices them.

    ``full_bytes_per_token``: the groups that keep every token, over all their layers. ``windows``: the
    sliding-window groups. ``state_bytes``: the recurrent state of one sequence over all recurrent layers (0: no
    recurrent group). ``interval_tokens``: the engine keeps a checkpoint every so many tokens besides the
    semantic ones (0: none). ``source``: where the figures come from.
    """

    name: str
    full_bytes_per_token: float
    windows: tuple[WindowGroup, ...] = ()
    state_bytes: int = 0
    interval_tokens: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.full_bytes_per_token > 0:
            raise ValueError(f"hybrid model {self.name!r}: a hit needs a full-history group (bytes per token > 0)")
        if self.state_bytes < 0 or self.interval_tokens < 0:
            raise ValueError(f"hybrid model {self.name!r}: state bytes and interval must be >= 0")
        if not self.windows and not self.state_bytes:
            raise ValueError(f"hybrid model {self.name!r} has neither a window nor a recurrent group: "
                             "it is a uniform model (use --model with a layout)")

    @property
    def recurrent(self) -> bool:
        return self.state_bytes > 0

    def full_block_bytes(self, block_tokens: int) -> int:
        return round(self.full_bytes_per_token * block_tokens)

    def window_block_bytes(self, group: WindowGroup, block_tokens: int) -> int:
        return round(group.bytes_per_token * block_tokens)

    def checkpoint_bytes(self, block_tokens: int) -> int:
        """What one checkpoint stores besides the full-history blocks: its state and every window tail."""
        return self.state_bytes + sum(g.tail_blocks(block_tokens) * self.window_block_bytes(g, block_tokens)
                                      for g in self.windows)

    def layout(self, block_tokens: int) -> BlockLayout:
        """One packed block holding every group whole: the full-history and window groups' bytes of its tokens
        and the recurrent state at its end (what a store that packs every group of a block keeps)."""
        groups = [CacheGroup("full", "attention", 1, (("bytes", (self.full_block_bytes(block_tokens),)),), "uint8")]
        groups += [CacheGroup(g.name, "sliding_window", 1, (("bytes", (self.window_block_bytes(g, block_tokens),)),),
                              "uint8") for g in self.windows]
        if self.state_bytes:
            groups.append(CacheGroup("state", "recurrent", 1, (("bytes", (self.state_bytes,)),), "uint8"))
        return BlockLayout.hybrid(block_tokens, groups, align=1)

    def describe(self, block_tokens: int) -> str:
        parts = [f"full {self.full_bytes_per_token:,.0f} B/token"]
        parts += [f"{g.name} {g.bytes_per_token:,.0f} B/token x window {g.window} "
                  f"({g.tail_blocks(block_tokens)} blocks)" for g in self.windows]
        if self.state_bytes:
            parts.append(f"state {self.state_bytes / 2**20:,.1f} MiB per checkpoint")
        if self.interval_tokens:
            parts.append(f"a checkpoint every {self.interval_tokens} tokens")
        return "; ".join(parts)


STATE = -1  # the group index boundary_objects gives the recurrent state


def boundary_objects(d: int, tails: Sequence[int], recurrent: bool) -> list[tuple[int, int]]:
    """What restoring at boundary ``d`` (in blocks) needs besides the full-history blocks before it: the state
    at d, as ``(STATE, d)``, and each window group g's blocks i before d that its window covers, as ``(g, i)``
    (``tails[g]`` of them, fewer near the root)."""
    out = [(STATE, d)] if recurrent and d else []
    for g, t in enumerate(tails):
        out += [(g, i) for i in range(max(0, d - t), d)]
    return out


def restorable_depth(full_prefix: int, candidates: Iterable[int], tails: Sequence[int], recurrent: bool,
                     held: Callable[[list[tuple[int, int]]], bool]) -> int:
    """The deepest boundary at which every group can be restored: among ``candidates`` (the boundaries the
    engine ever checkpointed), the deepest within the ``full_prefix`` leading full-history blocks held whose
    ``boundary_objects`` ``held`` says are all there; 0 (nothing restored) if none."""
    for d in sorted(candidates, reverse=True):
        if 0 < d <= full_prefix and held(boundary_objects(d, tails, recurrent)):
            return d
    return 0


def checkpoints(blocks: int, restored: int, junction: int, interval_blocks: int) -> list[int]:
    """Boundaries a request's prefill creates a checkpoint at, past ``restored`` (the boundary it resumed
    from, whose state exists already): the end of its prompt (``blocks``), the fork junction (``junction``:
    leading blocks seen before this request; a checkpoint when the prefill passes through it), and every
    ``interval_blocks`` (0: none)."""
    out = {blocks} if blocks > restored else set()
    if restored < junction < blocks:
        out.add(junction)
    if interval_blocks > 0:
        first = (restored // interval_blocks + 1) * interval_blocks
        out.update(range(first, blocks, interval_blocks))
    out.discard(0)
    return sorted(out)


# ---- presets: figures from the models' public configs --------------------------------------------------

def _gemma3_27b() -> HybridModel:
    # google/gemma-3-27b-it config.json (text_config): num_hidden_layers 62, num_key_value_heads 16,
    # head_dim 128, sliding_window 1024, sliding_window_pattern 6 (transformers' Gemma3TextConfig: layer i
    # is full attention when (i + 1) % 6 == 0, so 10 full layers and 52 sliding-window layers); bf16 K and V.
    kv_per_layer = 2 * 16 * 128 * 2  # K and V, 16 KV heads x 128, 2 bytes
    return HybridModel("gemma-3-27b", full_bytes_per_token=10 * kv_per_layer,
                       windows=(WindowGroup("sliding", 52 * kv_per_layer, 1024,),),
                       source="google/gemma-3-27b-it config.json")


def _qwen3_next_80b() -> HybridModel:
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (the defaults of transformers' Qwen3NextConfig):
    # num_hidden_layers 48, full_attention_interval 4 (12 full-attention layers, 36 GatedDeltaNet layers),
    # num_key_value_heads 2, head_dim 256; linear_num_key_heads 16, linear_num_value_heads 32,
    # linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4; bf16 KV and state.
    # A GatedDeltaNet layer's state as vLLM keeps it: the conv state (conv_dim x (kernel - 1), conv_dim =
    # 2 x 16 x 128 + 32 x 128 = 8192) and the recurrent state (32 value heads x 128 x 128).
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1)
    recurrent = 32 * 128 * 128
    return HybridModel("qwen3-next-80b-a3b", full_bytes_per_token=12 * 2 * 2 * 256 * 2,
                       state_bytes=36 * (conv + recurrent) * 2,
                       source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json")


def _deepseek_v4_flash() -> HybridModel:
    # deepseek-ai/DeepSeek-V4-Flash-Base (transformers' DeepseekV4Config defaults): 43 layers, head_dim 512,
    # one shared KV head, sliding_window 128 in every layer, layer_types 2 x heavily compressed (HCA, rate
    # 128) then CSA (rate 4) / HCA interleaved: 20 CSA and 23 HCA layers; index_head_dim 128 (CSA layers).
    # Bytes per cache entry from vLLM's DeepSeek V4 model (models/deepseek_v4/attention.py, fp8_ds_mla):
    # 584 B per compressed KV entry (448 NoPE + 128 RoPE + 8 scale), 132 B per indexer entry (128 fp8 + 4);
    # the sliding-window KV 584 B per token. The compressors' running state (compressor.py: fp32,
    # 2 x coff x head_dim per token over a window of coff x rate tokens; coff 2 for CSA, 1 for HCA) is window
    # state too: CSA 20 layers x (2 x 2 x 512 + 2 x 2 x 128 indexer) x 4 B over 8 tokens, HCA 23 x 2 x 512 x 4 B
    # over 128 tokens.
    csa, hca = 20, 23
    return HybridModel(
        "deepseek-v4-flash", full_bytes_per_token=csa * (584 + 132) / 4 + hca * 584 / 128,
        windows=(WindowGroup("swa", 43 * 584, 128),
                 WindowGroup("csa-compressor", csa * (2 * 2 * 512 + 2 * 2 * 128) * 4, 8),
                 WindowGroup("hca-compressor", hca * 2 * 512 * 4, 128)),
        source="deepseek-ai/DeepSeek-V4-Flash-Base config + vLLM's deepseek_v4 cache specs")


HYBRID_MODELS: dict[str, HybridModel] = {m.name: m for m in (_gemma3_27b(), _qwen3_next_80b(), _deepseek_v4_flash())}
