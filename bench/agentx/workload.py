"""What ``kvtier bench agentx`` sends: agentic-cc traces (kvtier.tools.replay.traces) turned into token-id prompts.

**Tokens from block hashes.** A trace records each request as its 64-token blocks' hash ids (prefix-chained:
equal ids, equal prefix). A prompt is built block by block: each engine block's ``block_tokens`` token ids are
drawn from a generator seeded by (the replay's salt, the trace block ids it stands for), so equal hashes give
equal tokens, and the engine's prefix cache (which hashes token blocks, chained) reuses exactly what the trace
reused. A trailing partial block (the request's own last tokens) is drawn from the request's own seed.

**Scaling to the model's context.** A trace's requests run to 300K tokens; a small model's context does not
hold them. Each trace gets a merge factor ``k``: ``k`` consecutive trace blocks become one engine block (the
smallest ``k`` that fits the trace's longest request, with its output, into ``max_model_len``). Token counts
are then scaled by ``block_tokens / (64 k)`` (``Scaled.token_scale``; output tokens too, capped by
``max_output``). One engine block per trace block (``k == 1``) is the finest a prompt can be without losing
prefix reuse; with ``k > 1`` a prefix shared for only part of a ``k``-group is recomputed, so reuse is measured
at ``k``-block granularity (a turn of an agentic trace appends tens of blocks, so little is lost). A trace
needing ``k > max_merge`` is skipped and counted.

**Salts.** Every replay of a trace gets its own salt (a fresh session never hits another's cache), and a
forked subagent inherits its parent's, so it reuses the parent's shared prefix as it did in the capture.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.tools.replay.traces import Step, Subagents, Trace, TraceRequest, expand_paths, read_trace, sample_traces

SAMPLE_TRACES = sample_traces()
LOW_TOKEN = 3  # below: the tiny model's special tokens (<unk>, <s>, </s>)


@dataclass(frozen=True)
class Scaling:
    """How traces are fitted to the engine: its block size, context, vocabulary, output cap and merge limit."""

    block_tokens: int = 32
    max_model_len: int = 2048
    vocab_size: int = 1000
    max_output: int = 64
    max_merge: int = 64

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_output < 1 or self.max_merge < 1:
            raise ValueError("block tokens, max output and max merge must be >= 1")
        if self.vocab_size <= LOW_TOKEN + 1:
            raise ValueError(f"vocab_size must be > {LOW_TOKEN + 1}, got {self.vocab_size}")
        if self.usable_blocks < 1:
            raise ValueError(f"max_model_len {self.max_model_len} leaves no room for one {self.block_tokens}-token "
                             f"block, a tail and {self.max_output} output tokens")

    @property
    def usable_blocks(self) -> int:
        """Engine blocks a prompt may hold: the context less one block (the tail) and the output."""
        return (self.max_model_len - self.max_output) // self.block_tokens - 1


@dataclass
class Scaled:
    """One trace fitted to the engine. ``merge``: trace blocks per engine block."""

    trace: Trace
    merge: int
    block_tokens: int

    @property
    def token_scale(self) -> float:
        return self.block_tokens / (self.trace.block_tokens * self.merge)


@dataclass
class Prompt:
    """One request as sent: token ids, output tokens, and its engine blocks' keys (what the cache model sees)."""

    tokens: list[int]
    max_tokens: int
    keys: list[bytes]


@dataclass
class TraceSet:
    """The traces a bench replays, fitted; ``skipped``: name -> why (a count goes in the report)."""

    scaled: list[Scaled]
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"traces": len(self.scaled), "skipped": len(self.skipped), "skipped_why": self.skipped,
                "merge": {s.trace.name: s.merge for s in self.scaled},
                "token_scale": {s.trace.name: round(s.token_scale, 5) for s in self.scaled}}


def load_traces(paths: Sequence[str | Path], scaling: Scaling) -> TraceSet:
    """agentic-cc traces (files or directories), each fitted to ``scaling`` or skipped with the reason."""
    out = TraceSet([])
    for path in expand_paths(paths):
        trace = read_trace(path, "agentic")
        longest = max((len(r.blocks) for r in trace.iter_requests()), default=0)
        if longest == 0:
            out.skipped[trace.name] = "no full block in any request"
            continue
        merge = max(1, math.ceil(longest / scaling.usable_blocks))
        if merge > scaling.max_merge:
            out.skipped[trace.name] = (f"its longest request ({longest} blocks) needs {merge} trace blocks per engine "
                                       f"block to fit max_model_len {scaling.max_model_len}; max_merge is "
                                       f"{scaling.max_merge}")
            continue
        out.scaled.append(Scaled(trace, merge, scaling.block_tokens))
    if not out.scaled:
        raise ValueError(f"no trace fits the model's context: {out.skipped}")
    return out


class PromptBuilder:
    """Token ids for requests of a scaled trace under a salt; block contents memoised per (salt, ids)."""

    def __init__(self, scaling: Scaling) -> None:
        self.scaling = scaling
        self._memo: dict[bytes, np.ndarray] = {}

    def _tokens(self, key: bytes, n: int) -> np.ndarray:
        got = self._memo.get(key)
        if got is None:
            seed = int.from_bytes(key[:8], "little")
            got = np.random.default_rng(seed).integers(LOW_TOKEN, self.scaling.vocab_size, n, dtype=np.int64)
            if len(self._memo) < 1_000_000:  # bounded: a long sweep draws fresh salts without end
                self._memo[key] = got
        return got

    def prompt(self, scaled: Scaled, req: TraceRequest, salt: int, serial: int, warmup: bool = False) -> Prompt:
        """``serial``: the request's number in its replay (seeds its tail); ``warmup``: one output token."""
        k, bt = scaled.merge, self.scaling.block_tokens
        raw = scaled.trace.raw_ids[req.blocks]
        full = len(raw) // k
        keys, parts = [], []
        for j in range(full):
            h = hashlib.blake2b(salt.to_bytes(8, "little") + raw[j * k:(j + 1) * k].astype("<i8").tobytes(),
                                digest_size=16).digest()
            keys.append(h)
            parts.append(self._tokens(h, bt))
        # The tail: what is left of the request past its full engine blocks, scaled, at least one token (its
        # own), under one block.
        scale = scaled.token_scale
        tail = min(bt - 1, max(1, round(req.input_tokens * scale) - full * bt))
        tail_key = hashlib.blake2b(b"tail" + salt.to_bytes(8, "little") + serial.to_bytes(8, "little"),
                                   digest_size=16).digest()
        parts.append(np.random.default_rng(int.from_bytes(tail_key[:8], "little")).integers(
            LOW_TOKEN, self.scaling.vocab_size, tail, dtype=np.int64))
        out = 1 if warmup else max(1, min(self.scaling.max_output, round(req.output_tokens * scale)))
        return Prompt(np.concatenate(parts).tolist(), out, keys)


class TraceOrder:
    """The replays lanes take, in a seeded order: traces shuffled, cycled, each replay a new salt."""

    def __init__(self, traces: TraceSet, seed: int) -> None:
        self.traces, self.rng = traces.scaled, random.Random(seed)
        self._order: list[Scaled] = []
        self.salts = 0

    def next(self) -> tuple[Scaled, int]:
        if not self._order:
            self._order = list(self.traces)
            self.rng.shuffle(self._order)
        self.salts += 1
        return self._order.pop(), self.rng.getrandbits(63) ^ self.salts

    def start_point(self, scaled: Scaled) -> int:
        """A lane's first replay starts 25-75% into its trace's top-level steps (seeded)."""
        n = len(scaled.trace.steps)
        return self.rng.randint(n // 4, max(n // 4, (3 * n) // 4))


__all__ = ["SAMPLE_TRACES", "Prompt", "PromptBuilder", "Scaled", "Scaling", "Step", "Subagents", "TraceOrder",
           "TraceSet", "load_traces"]
