"""Workload: the traces of one replay, parsed once, plus the keys each replay of a trace uses.

A sweep (policies x capacities) replays the same Workload many times; parsing and key hashing happen once
here, not per run. Every replay of a trace gets its own salt (folded into the key namespace), so two replays
of one trace, or two traces, never share a block; a timed trace (Mooncake) is replayed once, unsalted, since
its ids are global across the file.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.keys import Namespace
from kvtier.tools.replay.traces import Trace, TraceError, detect_format, expand_paths, read_trace


@dataclass(frozen=True)
class Replay:
    """One replay of one trace: ``index`` orders replays (and gives their block ids a range of their own)."""

    index: int
    trace: Trace
    repeat: int
    id_offset: int  # this replay's dense ids are id_offset + trace-local id in the access stream


@dataclass
class Workload:
    """Parsed traces and the order lanes take them in. Not thread-safe (one replayer at a time)."""

    traces: list[Trace]
    repeat: int = 1
    seed: int = 0
    source: str = ""
    _keys: dict[tuple[int, str], list[bytes]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.traces:
            raise TraceError("no traces to replay")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        sizes = {t.block_tokens for t in self.traces}
        if len(sizes) != 1:
            raise TraceError(f"traces mix block sizes {sorted(sizes)}; replay one block size at a time")
        if len({t.timed for t in self.traces}) != 1 or (self.timed and len(self.traces) != 1):
            raise TraceError("replay either conversation traces (agentic-cc) or one timed trace (Mooncake)")
        if self.timed and self.repeat != 1:
            raise TraceError("a timed trace (Mooncake) replays once: its arrival times are fixed")

    @property
    def timed(self) -> bool:
        return self.traces[0].timed

    @property
    def block_tokens(self) -> int:
        return self.traces[0].block_tokens

    @property
    def replays(self) -> list[Replay]:
        """Every (trace, repeat) in the order lanes take them: seeded shuffle, the same in every run."""
        pairs = [(t, k) for k in range(self.repeat) for t in self.traces]
        if not self.timed:
            random.Random(self.seed).shuffle(pairs)
        out, offset = [], 0
        for i, (t, k) in enumerate(pairs):
            out.append(Replay(i, t, k, offset))
            offset += t.unique_blocks
        return out

    @property
    def unique_blocks(self) -> int:
        """Distinct blocks over all replays (salted replays never share blocks)."""
        return sum(t.unique_blocks for t in self.traces) * self.repeat

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.traces) * self.repeat

    @property
    def input_tokens(self) -> int:
        return sum(t.input_tokens for t in self.traces) * self.repeat

    @property
    def block_accesses(self) -> int:
        return sum(t.block_accesses for t in self.traces) * self.repeat

    def keys(self, replay: Replay, namespace: Namespace) -> list[bytes]:
        """Store keys of one replay's blocks, indexed by trace-local dense id (hashed once, then cached)."""
        cache_key = (replay.index, namespace.digest.hex())
        keys = self._keys.get(cache_key)
        if keys is None:
            ns = namespace if self.timed else Namespace(
                namespace.model, namespace.layout, extra=f"replay:{replay.trace.name}#{replay.repeat}")
            raw = replay.trace.raw_ids.astype("<i8").tobytes()
            keys = ns.keys([raw[i:i + 8] for i in range(0, len(raw), 8)])
            self._keys[cache_key] = keys
        return keys

    def short(self) -> str:
        rep = f" x{self.repeat}" if self.repeat > 1 else ""
        where = Path(self.source).name or self.source
        n = len(self.traces)
        return f"{n} trace{'s' if n != 1 else ''}{rep} from {where}, {self.requests:,} requests"

    def describe(self) -> str:
        kind = "timed trace" if self.timed else "traces"
        rep = f" x{self.repeat}" if self.repeat > 1 else ""
        return (f"{len(self.traces)} {kind}{rep} from {self.source}: {self.requests:,} requests, "
                f"{self.input_tokens:,} input tokens, {self.unique_blocks:,} unique {self.block_tokens}-token "
                f"blocks")


def load_workload(
    paths: Sequence[str | Path], fmt: str | None = None, limit: int | None = None, repeat: int = 1,
    seed: int = 0, on_file: Callable[[Path], None] | None = None,
) -> Workload:
    """Read trace files (directories expand to their trace files sorted by name); ``limit``: the first N."""
    files = expand_paths(paths)
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"limit must be > 0, got {limit}")
        files = files[:limit]
    formats = {fmt or detect_format(f) for f in files}
    if len(formats) != 1:
        raise TraceError(f"mixed trace formats ({', '.join(sorted(formats))}); pass one kind, or --format")
    traces = []
    for f in files:
        traces.append(read_trace(f, fmt))
        if on_file is not None:
            on_file(f)
    source = str(paths[0]) if len(paths) == 1 else f"{len(paths)} paths"
    return Workload(traces, repeat=repeat, seed=seed, source=source)
