"""Policies by name or import path: ``make_policy("s3fifo", capacity)``, ``make_policy("pkg.mod:MyPolicy", n)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.registry import ClassRegistry


def _load_builtins() -> None:
    # Importing the modules runs their @register_policy decorators.
    from kvtier.policies import fifo, lru, s3fifo  # noqa: F401


_POLICIES = ClassRegistry("eviction policy", _load_builtins)


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy class available under ``name``."""
    return _POLICIES.register(name)


def known_policies() -> list[str]:
    return _POLICIES.names()


def policy_class(spec: str) -> type:
    """The class registered as ``spec``, or imported from 'package.module:Class' / 'package.module.Class'."""
    return _POLICIES.get(spec)


def make_policy(spec: str, capacity: int, **kwargs: Any) -> Any:
    """Build a policy for a tier holding at most ``capacity`` blocks."""
    return policy_class(spec)(capacity, **kwargs)
