"""The closed loop of ``kvtier bench agentx``: N lanes replaying agentic sessions against one server.

Each lane replays one trace at a time as its session DAG: a request waits for its predecessor plus the
recorded think time (capped); subagents spawn from their parent's request (after their recorded delay, capped)
and the parent's next request waits for all of them. A finished session's lane takes the next replay.

Warm-up: each lane's first replay starts at a seeded point 25-75% into its trace; the requests before it are
sent first, in order, with one output token and no think time (the cache then holds what a session in progress
would have left). When every lane is warm (or ``warmup_s`` has passed), the measured window opens: the server's
metrics are read, and for ``duration_s`` lanes send requests. Then no request starts; those in flight get
``grace_s`` to finish, and are cut at its end (counted, not timed). The run never outlives
``warmup_s + duration_s + grace_s`` (plus one metrics read).

A server that refuses connections or stalls (no bytes for ``stall_s``) fails the request; when the server is
gone (``alive()`` says so) the run stops at once and says when: what completed before stays in the result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.bench.agentx.client import Completion, Endpoint, StreamError, complete
from kvtier.bench.agentx.workload import PromptBuilder, Scaled, Step, Subagents, TraceOrder
from kvtier.tools.replay.traces import inline
from kvtier.tools.replay.traces import TraceRequest


@dataclass(frozen=True)
class LoopConfig:
    """How a run is bounded (seconds): the window, its grace, the warm-up, the think-time cap, a stall."""

    lanes: int
    duration_s: float
    grace_s: float = 30.0
    warmup_s: float = 600.0
    think_cap_s: float = 60.0
    stall_s: float = 120.0

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.duration_s <= 0 or self.grace_s < 0 or self.warmup_s < 0:
            raise ValueError("lanes >= 1, duration > 0, grace >= 0 and warm-up >= 0 are required")
        if self.think_cap_s < 0 or self.stall_s <= 0:
            raise ValueError("think-time cap must be >= 0 s and the stall bound > 0 s")


@dataclass
class Sent:
    """One request: its lane, replay (salt), phase, engine-block keys and what came back (or its error)."""

    lane: int
    salt: int
    phase: str  # "warmup" or "window"
    keys: list[bytes]
    prompt_len: int
    max_tokens: int
    sent: float
    result: Completion | None = None
    error: str | None = None  # why it failed; None while it runs and when it completed
    cut: bool = False  # in flight at the end of the grace period (not a failure of the server)


@dataclass
class LoopResult:
    sent: list[Sent] = field(default_factory=list)
    window_start: float = 0.0
    window_end: float = 0.0  # the last completion in the window, or the cut
    metrics_before: dict[str, float] = field(default_factory=dict)
    warmup_cut: int = 0  # lanes whose warm-up did not finish within warmup_s
    server_died_at: float | None = None  # seconds into the window
    notes: list[str] = field(default_factory=list)


class _Stop(Exception):
    """No more requests: the window ended or the server is gone."""


class ClosedLoop:
    """One run's lanes, all tasks of one asyncio loop (``run_loop``'s); single use. ``metrics``: reads the
    server's counters (called in a thread at the window's start); ``alive``: whether the server is still there
    (called in a thread after a failed request)."""

    def __init__(self, endpoint: Endpoint, order: TraceOrder, builder: PromptBuilder, cfg: LoopConfig,
                 metrics: Callable[[], dict[str, float]], alive: Callable[[], bool]) -> None:
        self.ep, self.order, self.builder, self.cfg = endpoint, order, builder, cfg
        self.read_metrics, self.alive = metrics, alive
        self.out = LoopResult()
        self._serial = 0
        self._stop_at = float("inf")  # no request starts after this
        self._cut_at = float("inf")  # in-flight requests end here
        self._dead = asyncio.Event()

    async def run(self) -> LoopResult:
        t0 = time.monotonic()
        warm_until = t0 + self.cfg.warmup_s
        firsts = [self.order.next() for _ in range(self.cfg.lanes)]
        starts = [self.order.start_point(s) for s, _ in firsts]
        warm = [asyncio.create_task(self._warm(i, s, salt, start, warm_until))
                for i, ((s, salt), start) in enumerate(zip(firsts, starts))]
        done, pending = await asyncio.wait(warm, timeout=max(0.0, warm_until - time.monotonic()))
        for t in pending:
            t.cancel()
        self.out.warmup_cut = len(pending)
        await asyncio.gather(*pending, return_exceptions=True)
        if self._dead.is_set():
            return self.out
        self.out.metrics_before = await asyncio.to_thread(self.read_metrics)
        start = time.monotonic()
        self.out.window_start = start
        self._stop_at = start + self.cfg.duration_s
        self._cut_at = self._stop_at + self.cfg.grace_s
        lanes = [asyncio.create_task(self._lane(i, firsts[i][0], firsts[i][1], starts[i]))
                 for i in range(self.cfg.lanes)]
        _, late = await asyncio.wait(lanes, timeout=max(0.0, self._cut_at - time.monotonic()))
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        ends = [s.result.done for s in self.out.sent if s.phase == "window" and s.result is not None]
        end = max([*ends, self._cut_at if late else start])
        if self.out.server_died_at is not None:
            end = start + self.out.server_died_at
        self.out.window_end = end
        return self.out

    # ---- lanes ---------------------------------------------------------------------------------------------

    async def _warm(self, lane: int, scaled: Scaled, salt: int, start: int, until: float) -> None:
        for serial, req in enumerate(inline(scaled.trace.steps[:start])):
            if time.monotonic() >= until:
                return
            try:
                await self._send(lane, scaled, req, salt, serial, "warmup", until)
            except _Stop:
                return

    async def _lane(self, lane: int, scaled: Scaled, salt: int, start: int) -> None:
        try:
            first = sum(1 for _ in inline(scaled.trace.steps[:start]))
            await self._agent(lane, scaled, scaled.trace.steps[start:], salt, [first], first_free=True)
            while True:
                scaled, salt = self.order.next()
                await self._agent(lane, scaled, scaled.trace.steps, salt, [0], first_free=True)
        except _Stop:
            return

    async def _agent(self, lane: int, scaled: Scaled, steps: Sequence[Step], salt: int, serial: list[int],
                     first_free: bool = False) -> None:
        """One agent's steps; ``serial``: the replay's request counter (shared with its subagents)."""
        for i, step in enumerate(steps):
            if isinstance(step, Subagents):
                await asyncio.gather(*(self._sub(lane, scaled, agent, salt, serial, delay)
                                       for agent, delay in zip(step.agents, step.spawn_delays)))
                continue
            if not (first_free and i == 0):
                await self._sleep(step.delay)
            n = serial[0]
            serial[0] += 1
            await self._send(lane, scaled, step, salt, n, "window", self._cut_at)

    async def _sub(self, lane: int, scaled: Scaled, agent: Sequence[Step], salt: int, serial: list[int],
                   delay: float) -> None:
        await self._sleep(delay)
        await self._agent(lane, scaled, agent, salt, serial)  # a forked subagent inherits its parent's salt

    async def _sleep(self, delay: float) -> None:
        wake = time.monotonic() + min(delay, self.cfg.think_cap_s)
        if wake >= self._stop_at:
            await asyncio.sleep(max(0.0, self._stop_at - time.monotonic()))
            raise _Stop
        await asyncio.sleep(max(0.0, wake - time.monotonic()))

    async def _send(self, lane: int, scaled: Scaled, req: TraceRequest, salt: int, serial: int, phase: str,
                    until: float) -> None:
        if self._dead.is_set() or (phase == "window" and time.monotonic() >= self._stop_at):
            raise _Stop
        p = self.builder.prompt(scaled, req, salt, serial, warmup=phase == "warmup")
        s = Sent(lane, salt, phase, p.keys, len(p.tokens), p.max_tokens, time.monotonic())
        self.out.sent.append(s)
        try:
            s.result = await complete(self.ep, p.tokens, p.max_tokens, until, self.cfg.stall_s)
        except asyncio.CancelledError:
            s.error, s.cut = "cut at the end of the grace period", True
            raise
        except StreamError as e:
            s.error = str(e)
            if not await asyncio.to_thread(self.alive):
                if not self._dead.is_set():
                    self._dead.set()
                    w = self.out.window_start
                    self.out.server_died_at = round(time.monotonic() - w, 2) if w else 0.0
                    when = f"{self.out.server_died_at} s into the window" if w else "in the warm-up"
                    self.out.notes.append(f"the server is gone ({e}); the run stopped {when}")
                raise _Stop from None


def run_loop(endpoint: Endpoint, order: TraceOrder, builder: PromptBuilder, cfg: LoopConfig,
             metrics: Callable[[], dict[str, float]], alive: Callable[[], bool]) -> LoopResult:
    """Run the closed loop to its end (bounded, see the module's doc)."""
    return asyncio.run(ClosedLoop(endpoint, order, builder, cfg, metrics, alive).run())
