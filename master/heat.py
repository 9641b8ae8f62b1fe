"""HeatClock: exponentially decayed access counts with no per-entry work as time passes.

A key's heat is the sum over its accesses of 2^(-(now - t_access) / half_life). Stored naively it would need
every entry rescaled as time passes; instead each entry keeps a *score* in units of the clock's epoch ``t0``:
an access at time t adds 2^((t - t0) / half_life), and heat(now) = score * 2^(-(now - t0) / half_life).
When the exponent gets large (float32 scores top out near 2^127), ``renormalize`` rescales every score once
and moves ``t0`` to now; at a 10-minute half-life that happens about once every ten hours.

Wall-clock seconds (time.time), not monotonic: t0 and scores are persisted and must mean the same after a
restart. Pure arithmetic; not thread-safe (owned by the master loop).
"""

from __future__ import annotations

import math

import numpy as np

RENORMALIZE_EXPONENT = 60.0  # 2^60 * a count of 2^32 stays far below float32's 2^127


class HeatClock:
    """Converts between stored scores and heat at a given time; ``half_life_s`` > 0."""

    def __init__(self, half_life_s: float, t0: float) -> None:
        if not half_life_s > 0:
            raise ValueError(f"heat half-life must be > 0 seconds, got {half_life_s}")
        self.half_life_s = half_life_s
        self.t0 = t0

    def weight(self, now: float) -> float:
        """What one access at ``now`` adds to a score."""
        return 2.0 ** ((now - self.t0) / self.half_life_s)

    def heat(self, scores: np.ndarray, now: float) -> np.ndarray:
        """Decayed heat at ``now`` of stored scores (float64, so a cold entry does not round to 0 early). A time
        before the epoch (a wall clock stepped back, or the log entries of a master whose clock is ahead) is
        answered as at the epoch: 2^((t0 - now) / half_life) overflows a float ~1,000 half-lives back."""
        return scores.astype(np.float64) * 2.0 ** (-max(now - self.t0, 0.0) / self.half_life_s)

    def needs_renormalize(self, now: float) -> bool:
        return (now - self.t0) / self.half_life_s > RENORMALIZE_EXPONENT

    def renormalize(self, scores: np.ndarray, now: float) -> None:
        """Rescale ``scores`` in place so that ``t0`` can move to ``now``."""
        factor = 2.0 ** (-(now - self.t0) / self.half_life_s)
        if math.isfinite(factor):
            scores *= np.float32(factor)
        self.t0 = now
