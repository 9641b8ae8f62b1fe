"""Trace readers: agentic-cc (WEKA JSON, one conversation tree a file) and Mooncake (JSONL, one request a line).

Both become the same compact form, parsed once and shared by every run of a sweep: a ``Trace`` whose requests
hold their full blocks as dense int32 ids (0..unique-1, local to the trace), so the replayer and the offline
optimum work on numpy arrays, not on Python lists of trace ids. A trailing partial block is never cacheable
(engines cache full blocks only), so a request's blocks are ``input_tokens // block_size`` ids.

agentic-cc timing, as this capture records it (checked on all 482 files of the set):
* a request's ``think_time`` is the client's time between the previous request's completion and this one;
* a subagent's ``t`` is when it *finished* (``t - duration_ms/1000`` falls right after the parent's previous
  request ended); consecutive subagent entries were spawned together, and the parent's next request came
  ``next.t - max(subagent t)`` seconds after the last of them finished.

Bad input raises ``TraceError`` naming the file and the line (JSONL) or the request's path in the tree.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np


def sample_traces() -> Path:
    """The agentic-cc sample shipped as package data (ten traces, Apache-2.0, NOTICE.md beside them): what
    ``kvtier demo`` and ``kvtier bench agentx`` replay by default. A fresh clone or wheel has it; ``../shared``
    need not exist."""
    return Path(str(importlib.resources.files("kvtier").joinpath("sample-traces", "agentic-cc")))

AGENTIC_BLOCK_TOKENS = 64
MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("agentic", "mooncake")


class TraceError(ValueError):
    """A trace file is unreadable or malformed; the message names the file and the line or request."""


class TraceRequest:
    """One model call of a trace (not an engine's request). ``blocks``: dense ids of its full blocks in prefix
    order (int32, distinct).

    ``delay``: seconds between the previous step of its agent completing and this request being sent
    (uncapped; the replayer caps it). For a timed trace (Mooncake) it is the arrival time from the start.
    ``stop``: the stop reason the trace recorded (agentic-cc: ``tool_use``, ``end_turn``, ...; None where it has
    none, as Mooncake); ``api_time``: the model's recorded time for it in seconds (None where not recorded).
    """

    __slots__ = ("blocks", "input_tokens", "output_tokens", "delay", "stop", "api_time")

    def __init__(self, blocks: np.ndarray, input_tokens: int, output_tokens: int, delay: float,
                 stop: str | None = None, api_time: float | None = None) -> None:
        self.blocks = blocks
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.delay = delay
        self.stop = stop
        self.api_time = api_time


@dataclass(frozen=True)
class Subagents:
    """Subagents spawned together after their parent's previous request; the parent's next step waits for
    all of them. ``spawn_delays[i]``: seconds after that request completed that agent i started."""

    agents: tuple[tuple[Step, ...], ...]
    spawn_delays: tuple[float, ...]


Step = Union[TraceRequest, Subagents]


def inline(steps: Sequence[Step]) -> Iterator[TraceRequest]:
    """A conversation's requests in the order a sequential replay sends them: each subagent's requests where it
    was spawned."""
    for step in steps:
        if isinstance(step, TraceRequest):
            yield step
        else:
            for agent in step.agents:
                yield from inline(agent)


@dataclass
class Trace:
    """One parsed trace. ``timed``: requests arrive at fixed times (Mooncake) instead of in a conversation."""

    name: str
    block_tokens: int
    steps: tuple[Step, ...]
    unique_blocks: int
    timed: bool = False
    requests: int = 0
    input_tokens: int = 0
    block_accesses: int = 0
    raw_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)

    def iter_requests(self) -> Iterable[TraceRequest]:
        """Every request of the tree, parents before their subagents."""
        stack: list[Sequence[Step]] = [self.steps]
        while stack:
            for step in stack.pop():
                if isinstance(step, TraceRequest):
                    yield step
                else:
                    stack.extend(step.agents)


def detect_format(path: Path) -> str:
    return "mooncake" if path.name.endswith((".jsonl", ".jsonl.gz")) else "agentic"


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; a directory contributes its *.json, *.json.gz and *.jsonl files sorted by name."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(
                (".json", ".json.gz", ".jsonl", ".jsonl.gz")))
            if not found:
                raise TraceError(f"{p}: no trace files (*.json, *.json.gz, *.jsonl) in this directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise TraceError(f"{p}: no such trace file or directory")
    return out


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    """Read one file in ``fmt`` ("agentic" or "mooncake"; by default from its name)."""
    p = Path(path)
    fmt = fmt or detect_format(p)
    if fmt == "agentic":
        return read_agentic(p)
    if fmt == "mooncake":
        return read_mooncake(p)
    raise TraceError(f"{p}: unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")


def _open_text(p: Path) -> Any:
    return gzip.open(p, "rt", encoding="utf-8") if p.name.endswith(".gz") else open(p, encoding="utf-8")


# ---- agentic-cc ------------------------------------------------------------------------------------------

def read_agentic(path: str | Path) -> Trace:
    p = Path(path)
    try:
        with _open_text(p) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{p}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceError(f"{p}: cannot read: {e}") from None
    return parse_agentic(doc, p)


def parse_agentic(doc: Any, path: str | Path = "<trace>") -> Trace:
    """An agentic-cc trace from its decoded JSON; ``path`` names it in errors."""
    p = Path(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceError(f"{p}: not an agentic-cc trace (expected an object with a 'requests' list)")
    bs = doc.get("block_size", AGENTIC_BLOCK_TOKENS)
    if type(bs) is not int or bs <= 0:  # noqa: E721 - bool is not a block size
        raise TraceError(f"{p}: block_size must be a positive integer, got {bs!r}")
    parser = _IdCollector(p, bs)
    steps = parser.agent(doc["requests"], "requests")
    name = str(doc.get("id") or p.name.split(".")[0])
    return parser.finish(Trace(name, bs, steps, 0))


class _IdCollector:
    """Builds Requests while collecting their raw block ids; ``finish`` maps them to dense ids at once."""

    def __init__(self, path: Path, block_tokens: int) -> None:
        self.path, self.bs = path, block_tokens
        self.requests: list[TraceRequest] = []
        self.raw: list[np.ndarray] = []

    def fail(self, where: str, msg: str) -> TraceError:
        return TraceError(f"{self.path}: {where}: {msg}")

    def request(self, r: dict[str, Any], where: str, delay: float, in_key: str, out_key: str) -> TraceRequest:
        in_tok, out_tok, ids = r.get(in_key), r.get(out_key, 0), r.get("hash_ids")
        if type(in_tok) is not int or in_tok < 0:  # noqa: E721
            raise self.fail(where, f"'{in_key}' must be a non-negative integer, got {in_tok!r}")
        if type(out_tok) is not int or out_tok < 0:  # noqa: E721
            raise self.fail(where, f"'{out_key}' must be a non-negative integer, got {out_tok!r}")
        if not isinstance(ids, list):
            raise self.fail(where, "missing 'hash_ids' (a list of block ids)")
        full = in_tok // self.bs
        if len(ids) < full:
            raise self.fail(where, f"{len(ids)} hash_ids for {in_tok} input tokens; expected at least "
                                   f"{full} ({self.bs}-token blocks)")
        try:
            arr = np.array(ids[:full], dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise self.fail(where, "hash_ids must be integers") from None
        if arr.ndim != 1:
            raise self.fail(where, "hash_ids must be a flat list of integers")
        stop = r.get("stop")
        if stop is not None and not isinstance(stop, str):
            raise self.fail(where, f"'stop' must be a string (a stop reason), got {stop!r}")
        api = r.get("api_time")
        api_time = _number(api, self, where, "api_time") if api is not None else None
        req = TraceRequest(arr, in_tok, out_tok, delay, stop or None, api_time)
        self.requests.append(req)
        self.raw.append(arr)
        return req

    def agent(self, entries: list[Any], where: str) -> tuple[Step, ...]:
        steps: list[Step] = []
        prev_end = 0.0  # trace time when the previous step of this agent ended
        group: list[tuple[tuple[Step, ...], float, float]] = []  # (steps, spawn time, end time)
        for i, r in enumerate(entries):
            at = f"{where}[{i}]"
            if not isinstance(r, dict):
                raise self.fail(at, f"expected an object, got {type(r).__name__}")
            t = _number(r.get("t", 0.0), self, at, "t")
            if r.get("type") == "subagent":
                inner = r.get("requests")
                if not isinstance(inner, list):
                    raise self.fail(at, "a subagent needs a 'requests' list")
                dur = r.get("duration_ms")
                span = _number(dur, self, at, "duration_ms") / 1000 if dur is not None else _span(inner)
                group.append((self.agent(inner, f"{at}.requests"), t - span, t))
                continue
            if group:
                steps.append(Subagents(tuple(g[0] for g in group),
                                       tuple(max(0.0, g[1] - prev_end) for g in group)))
                delay = max(0.0, t - max(g[2] for g in group))
                prev_end, group = max(g[2] for g in group), []
            elif "think_time" in r:
                delay = _number(r["think_time"], self, at, "think_time")
            else:
                delay = max(0.0, t - prev_end) if steps else 0.0
            req = self.request(r, at, max(0.0, delay), "in", "out")
            steps.append(req)
            prev_end = t + (req.api_time or 0.0)
        if group:
            steps.append(Subagents(tuple(g[0] for g in group), tuple(max(0.0, g[1] - prev_end) for g in group)))
        return tuple(steps)

    def finish(self, trace: Trace) -> Trace:
        """Map raw ids to dense ids 0..unique-1 and fill in the trace's totals."""
        if self.raw:
            lengths = np.fromiter((len(a) for a in self.raw), dtype=np.int64, count=len(self.raw))
            uniq, dense = np.unique(np.concatenate(self.raw), return_inverse=True)
            parts = np.split(dense.astype(np.int32), np.cumsum(lengths)[:-1])
        else:
            uniq, parts = np.empty(0, np.int64), []
        for k, (req, ids) in enumerate(zip(self.requests, parts)):
            if len(ids) > 1 and np.unique(ids).size != ids.size:
                raise TraceError(f"{self.path}: request {k} repeats a block id within its hash_ids; ids "
                                 "must be prefix-chained (distinct within one request)")
            req.blocks = ids
        trace.unique_blocks = len(uniq)
        trace.raw_ids = uniq
        trace.requests = len(self.requests)
        trace.input_tokens = sum(r.input_tokens for r in self.requests)
        trace.block_accesses = sum(len(r.blocks) for r in self.requests)
        return trace


def _number(v: Any, c: _IdCollector, where: str, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise c.fail(where, f"'{name}' must be a number, got {v!r}")
    return float(v)


def _span(inner: list[Any]) -> float:
    """A subagent's duration from its own requests, when the trace has no duration_ms."""
    last = next((r for r in reversed(inner) if isinstance(r, dict) and r.get("type") != "subagent"), None)
    if last is None:
        return 0.0
    t, api = last.get("t", 0.0), last.get("api_time", 0.0)
    return float(t) + float(api) if isinstance(t, (int, float)) and isinstance(api, (int, float)) else 0.0


# ---- Mooncake ----------------------------------------------------------------------------------------------

def read_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """JSONL, one request a line: timestamp (ms), input_length, output_length, hash_ids (global, chained)."""
    p = Path(path)
    parser = _IdCollector(p, block_tokens)
    arrivals: list[float] = []
    try:
        with _open_text(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                at = f"line {lineno}"
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{p}: {at}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(r, dict):
                    raise parser.fail(at, f"expected an object, got {type(r).__name__}")
                ts = _number(r.get("timestamp"), parser, at, "timestamp") / 1000.0
                parser.request(r, at, ts, "input_length", "output_length")
                arrivals.append(ts)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceError(f"{p}: cannot read: {e}") from None
    if not parser.requests:
        raise TraceError(f"{p}: no requests")
    order = np.argsort(np.asarray(arrivals), kind="stable")  # issue in time order; ties keep file order
    steps = tuple(parser.requests[i] for i in order)
    return parser.finish(Trace(p.name.split(".")[0], block_tokens, steps, 0, timed=True))
