"""What an engine knows online about the requests behind the blocks, handed to eviction policies in batches.

An engine (or its connector) sees each request arrive with its full block chain, sees it finish with a stop
reason, and may hear hints from the client or the agent harness. ``TieredStore.observe`` takes these
observations, fills in the agent each one belongs to (``kvtier.policies.sessions``) and forwards them to the
tiers whose policies use them. Policies read the fields; nothing here is mutated after construction.

Times are seconds on the store's clock (``time.monotonic`` unless the store was given another one); ``None``
means "now" and is filled in by ``TieredStore.observe`` (a vLLM worker stamps the scheduler's observations when
it applies them: the scheduler's clock is not the worker's on another host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Stop reasons as the callers report them. Free-form strings: a policy learns one distribution per value it
# sees, with no prior on what any value means. These are the common ones.
STOP = "stop"  # the model ended its answer (vLLM FinishReason.STOP; a stop token or string)
LENGTH = "length"  # max_tokens reached
ABORT = "abort"  # the client went away or the request was cancelled
TOOL_USE = "tool_use"  # the answer is a tool call: the agent comes back when its tool has run
END_TURN = "end_turn"  # the answer is for a human: the agent comes back when the human answers
SUBAGENTS = "subagents"  # not reported by an engine: what a "waiting on N subagents" hint turns a stop into


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request arrived: ``keys`` is its full block chain, root first (position = depth in the chain).

    ``session``: the client's session (agent) id, or None to let the store infer it (a chain that extends an
    earlier request's chain belongs to that request's agent).

    ``checkpoints``: a hybrid model's checkpoints the request restores from or makes, each as (boundary: the
    blocks of the chain before it, the store keys of its objects: recurrent state, window tails). Its objects
    live and die together, and the session-aware policy keeps them by agent (checkpoints.py).
    """

    request: str
    keys: Sequence[bytes]
    time: float | None = None
    session: str | None = None
    checkpoints: Sequence[tuple[int, Sequence[bytes]]] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    """A request finished at ``time`` with ``stop`` (see the constants above; None: not known).

    ``keys``: blocks the request added after its arrival chain (generated tokens an engine saves), at depths
    following the chain's; they belong to the request's agent. ``session`` is filled by the store."""

    request: str
    time: float | None = None
    stop: str | None = None
    keys: Sequence[bytes] = ()
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Hint:
    """What the client or the harness says about an agent, by its request or its session.

    ``finished``: the agent will not come back (its blocks go first). ``subagents``: after the request it
    waits for that many subagents (its gap is learned apart from other stops). ``ttl_s``: it expects to come
    back within that many seconds from ``time``. ``priority``: agents of lower priority are evicted first.
    None leaves a field as it was."""

    request: str | None = None
    session: str | None = None
    time: float | None = None
    finished: bool = False
    subagents: int = 0
    ttl_s: float | None = None
    priority: float | None = None


@dataclass(frozen=True, slots=True)
class Observations:
    """One batch, applied in order: arrivals, then completions, then hints."""

    arrivals: Sequence[Arrival] = field(default_factory=tuple)
    completions: Sequence[Completion] = field(default_factory=tuple)
    hints: Sequence[Hint] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.arrivals or self.completions or self.hints)


EMPTY = Observations()
