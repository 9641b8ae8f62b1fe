"""Policies by name or import path: ``make_policy("s3fifo", capacity)``, ``make_policy("pkg.mod:MyPolicy", n)``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, type] = {}


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy class available under ``name``."""

    def add(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"eviction policy {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return add


def known_policies() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def policy_class(spec: str) -> type:
    """The class registered as ``spec``, or imported from 'package.module:Class' / 'package.module.Class'."""
    _load_builtins()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if "." in spec or ":" in spec:
        module_name, _, attr = spec.replace(":", ".").rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load eviction policy {spec!r}: {e}") from None
    raise ValueError(f"unknown eviction policy {spec!r}; known: {', '.join(known_policies())} "
                     "(or an import path 'package.module:Class')")


def make_policy(spec: str, capacity: int, **kwargs: Any) -> Any:
    """Build a policy for a tier holding at most ``capacity`` blocks."""
    return policy_class(spec)(capacity, **kwargs)


def _load_builtins() -> None:
    # Importing the modules runs their @register_policy decorators.
    from kvtier.policies import fifo, lru, s3fifo  # noqa: F401
