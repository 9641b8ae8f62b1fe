"""Policies by name or import path: ``make_policy("s3fifo", capacity)``, ``make_policy("pkg.mod:MyPolicy", n)``.

``default`` names whatever kvtier's default policy is (``DEFAULT_POLICY``), so a config can follow it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier.registry import ClassRegistry

# The session-aware predictor (pnu.py): on agentic traffic it keeps the agents that come back soon, and it
# behaves as LRU where no agent is ever seen coming back (traffic without sessions). Evidence:
# docs/eviction.md "Eviction policies".
DEFAULT_POLICY = "pnu"
DEFAULT_NAME = "default"


def _load_builtins() -> None:
    # Importing the modules runs their @register_policy decorators.
    from kvtier.policies import arc, chain_lru, fifo, lru, pnu, s3fifo  # noqa: F401

    _POLICIES.register(DEFAULT_NAME)(pnu.PredictedNextUse)  # the class DEFAULT_POLICY names


_POLICIES = ClassRegistry("eviction policy", _load_builtins)


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy class available under ``name``."""
    return _POLICIES.register(name)


def known_policies() -> list[str]:
    """Registered names (``default`` among them)."""
    return _POLICIES.names()


def resolve_name(spec: str) -> str:
    """``default`` -> the default policy's name; anything else as given."""
    return DEFAULT_POLICY if spec == DEFAULT_NAME else spec


def policy_class(spec: str) -> type:
    """The class registered as ``spec`` (``default``: the default policy), or imported from
    'package.module:Class' / 'package.module.Class'."""
    return _POLICIES.get(resolve_name(spec))


def make_policy(spec: str, capacity: int, *, clock: Callable[[], float] | None = None, **kwargs: Any) -> Any:
    """Build a policy for a tier holding at most ``capacity`` blocks, reading time from ``clock``
    (``time.monotonic`` by default). A class written to the keys-only protocol (not a ``Policy``) is wrapped
    in ``KeysOnly``, so every tier can call ``observe`` and ``admit``."""
    from kvtier.policies.base import KeysOnly, Policy

    cls = policy_class(spec)
    if isinstance(cls, type) and issubclass(cls, Policy):
        return cls(capacity, clock=clock or time.monotonic, **kwargs)
    return KeysOnly(cls(capacity, **kwargs))
