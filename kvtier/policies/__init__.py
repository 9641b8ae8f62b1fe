"""Eviction and admission policies behind one protocol (base.py), selected by name or import path.

Keys-only: lru, fifo, s3fifo, arc. Observing (what the engine knows: observations.py): chain-lru, and pnu, the
session-aware predictor and the default (``default`` names it). A tier wraps its policy in GuardedPolicy.
"""

from kvtier.policies.base import Clock, EvictionPolicy, Policy
from kvtier.policies.observations import Arrival, Completion, Hint, Observations
from kvtier.policies.registry import (DEFAULT_POLICY, known_policies, make_policy, policy_class, register_policy,
                                      resolve_name)

__all__ = ["Arrival", "Clock", "Completion", "DEFAULT_POLICY", "EvictionPolicy", "Hint", "Observations", "Policy",
           "known_policies", "make_policy", "policy_class", "register_policy", "resolve_name"]
