"""ReturnModel: when, and whether, an agent comes back after a request, learned online per stop reason.

What is learned, from the observations alone (no prior on any stop reason):
* service times (arrival -> completion), a window of samples;
* per stop reason, the gaps of the agents that came back (completion -> next arrival), a window of samples;
* per stop reason, the share of completions after which the agent came back at all: a completion is settled
  as "came back" at the agent's next arrival, and as "did not" once it has waited longer than 9 in 10 gaps
  seen (and back again if it returns later); shares decay, so they follow the traffic. Agentic traffic comes back after ~99% of tool
  calls and ~85% of answers to a human; in a chat trace without sessions (Mooncake) after fewer than half of
  the requests, and a prediction that ignored it would keep blocks of agents that are gone.

A prediction is the median of that mixture (gaps of those who return, "never" for the others) given the time
already waited: with return share p, elapsed e and gap distribution G, the median is the q with
p (G(q) - G(e)) = (p (1 - G(e)) + 1 - p) / 2, or never (infinity) when none exists. With p = 1 it is the median
residual gap. O(log window) per prediction, O(window) memmove per new sample (per request, not per block).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque

from kvtier.policies.samples import Samples

INF = math.inf
# A completion is settled as "gone" once it waited longer than this share of the gaps seen: the longest gap
# would settle nothing for hours on a long-tailed trace (and the share would count the unsettled as coming back).
HORIZON_QUANTILE = 0.9
PREDICTIVE_SHARE = 2 / 3
MAX_STOPS = 64  # distinct stop reasons learned apart; the others share one
OTHER_STOP = "\x00other"


class Outcome:
    """One completion waiting to be settled (held by the agent until its next arrival)."""

    __slots__ = ("time", "stop", "state")

    PENDING, CAME_BACK, GONE = 0, 1, 2

    def __init__(self, time: float, stop: str) -> None:
        self.time, self.stop, self.state = time, stop, Outcome.PENDING


class _Stop:
    """What is known about one stop reason."""

    __slots__ = ("gaps", "back", "gone")

    def __init__(self, window: int) -> None:
        self.gaps = Samples(window)
        self.back = 0.0  # decayed counts of settled completions
        self.gone = 0.0


class ReturnModel:
    """Not thread-safe (its policy runs under its tier's lock). ``window``: samples kept per distribution;
    ``max_pending``: completions waiting to be settled (the oldest are settled as gone past it)."""

    def __init__(self, window: int = 1024, max_pending: int = 1 << 16) -> None:
        self.window, self.max_pending = window, max_pending
        self._decay = 1.0 - 1.0 / window
        self.service = Samples(window)
        self._all = _Stop(window)
        self._stops: dict[str, _Stop] = {}
        self._pending: deque[Outcome] = deque()
        self.returns = 0  # agents seen coming back, ever

    # ---- learning ------------------------------------------------------------------------------------

    def served(self, seconds: float) -> None:
        self.service.add(max(0.0, seconds))

    def completed(self, now: float, stop: str) -> Outcome:
        """A request finished with ``stop``; the returned Outcome is settled by ``came_back`` or by time."""
        self.settle(now)
        outcome = Outcome(now, stop)
        self._pending.append(outcome)
        while len(self._pending) > self.max_pending:
            self._gone(self._pending.popleft())
        return outcome

    def came_back(self, outcome: Outcome, now: float) -> None:
        """The agent of ``outcome`` arrived again at ``now``."""
        gap = max(0.0, now - outcome.time)
        for s in (self._stop(outcome.stop), self._all):
            s.gaps.add(gap)
            if outcome.state == Outcome.GONE:
                s.gone = max(0.0, s.gone - 1.0)  # it was given up too early: a gap longer than any seen
            if outcome.state != Outcome.CAME_BACK:
                s.back = s.back * self._decay + 1.0
        outcome.state = Outcome.CAME_BACK
        self.returns += 1

    def settle(self, now: float) -> None:
        """Completions that waited longer than 9 gaps in 10 are settled as gone (O(1) amortised: each once);
        one that comes back after all is counted back again (``came_back``)."""
        horizon = self._all.gaps.quantile(HORIZON_QUANTILE)
        if horizon is None:
            return
        pending = self._pending
        while pending and now - pending[0].time > horizon:
            self._gone(pending.popleft())

    def _gone(self, outcome: Outcome) -> None:
        if outcome.state == Outcome.PENDING:
            outcome.state = Outcome.GONE
            for s in (self._stop(outcome.stop), self._all):
                s.gone = s.gone * self._decay + 1.0

    def _stop(self, stop: str) -> _Stop:
        s = self._stops.get(stop)
        if s is None:
            if len(self._stops) >= MAX_STOPS:  # stop reasons are the callers' strings: a bounded set of them
                stop = OTHER_STOP
                s = self._stops.get(stop)
            if s is None:
                s = self._stops[stop] = _Stop(self.window)
        return s

    # ---- predicting ----------------------------------------------------------------------------------

    def idle(self, stop: str, waited: float) -> float:
        """Seconds until an agent idle for ``waited`` after a ``stop`` is back (INF: predicted never)."""
        s = self._stops.get(stop)
        if s is None or not len(s.gaps):
            s = self._all
        return _mixture_residual(s.gaps, self._share(s), waited)

    def in_flight(self, running: float) -> float:
        """Seconds until an agent whose request has run ``running`` is back: its residual service time, then
        a gap of a stop reason not known yet (all of them pooled)."""
        left = self.service.residual(running) or 0.0
        return left + _mixture_residual(self._all.gaps, self._share(self._all), 0.0)

    @property
    def predictive(self) -> bool:
        """Whether some stop reason (or all of them pooled) is followed by a return at least two times in
        three: then the prediction right after such a completion is within the middle half of its gaps (the
        mixture's median sits at or below their 75th percentile). Near one in two the median is at the far tail
        of the gaps, or does not exist: a prediction says nothing recency does not, and the policy should go
        by recency (a chat trace without sessions, Mooncake: about one in two)."""
        if not self.returns:
            return False
        return any(self._share(s) >= PREDICTIVE_SHARE for s in (self._all, *self._stops.values())
                   if s.back + s.gone > 0)

    def share(self, stop: str | None = None) -> float:
        """The learned share of completions after which the agent came back (1 until one is settled)."""
        s = self._all if stop is None else self._stops.get(stop, self._all)
        return self._share(s)

    def _share(self, s: _Stop) -> float:
        settled = s.back + s.gone
        if settled <= 0:
            s = self._all
            settled = s.back + s.gone
        return s.back / settled if settled > 0 else 1.0


def _mixture_residual(gaps: Samples, p: float, waited: float) -> float:
    values = gaps.values
    m = len(values)
    if not m or p <= 0.0:
        return INF
    waited = max(0.0, waited)
    i = bisect_right(values, waited)
    below = i / m
    f = below + 0.5 * (1.0 - below) + 0.5 * (1.0 - p) / p
    if f >= 1.0:
        return INF
    return max(0.0, values[min(m - 1, int(f * m))] - waited)
