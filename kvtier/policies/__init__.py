"""Eviction policies behind one small protocol (see base.py), selected by name or import path."""

from kvtier.policies.base import EvictionPolicy
from kvtier.policies.registry import known_policies, make_policy, policy_class, register_policy

__all__ = ["EvictionPolicy", "known_policies", "make_policy", "policy_class", "register_policy"]
