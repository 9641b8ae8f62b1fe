"""ClassRegistry: pluggable classes by registered name or by import path ('package.module:Class').

One mechanism for every pluggable family (eviction policies, the master's placement policies, ...), so each
family only names itself and its built-ins. Registration happens at import time (decorators); lookups are
plain dict reads. Thread-safe for lookups once the built-ins are loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_target(target: str) -> Any:
    """What ``target`` names, imported: 'package.module:Name' or 'package.module.Name' (ImportError or
    AttributeError when it is not there). The one reading of a plug-in's import path: registered classes here, the
    transports' and the tiers' tables (kvtier/transport/registry.py, kvtier/settings/tiers.py)."""
    module_name, _, attr = target.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


class ClassRegistry:
    """Classes of one family (``what``, e.g. "eviction policy", used in error messages). ``load_builtins`` is
    called before the first lookup, to import the modules whose decorators register the built-in classes."""

    def __init__(self, what: str, load_builtins: Callable[[], None] | None = None) -> None:
        self.what = what
        self._classes: dict[str, type] = {}
        self._load_builtins = load_builtins

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: make a class available under ``name``."""

        def add(cls: type) -> type:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.what} {name!r} is already registered to {self._classes[name].__qualname__}")
            self._classes[name] = cls
            return cls

        return add

    def _builtins(self) -> None:
        if self._load_builtins is not None:
            self._load_builtins()

    def names(self) -> list[str]:
        self._builtins()
        return sorted(self._classes)

    def get(self, spec: str) -> type:
        """The class registered as ``spec``, or imported from 'package.module:Class' / 'package.module.Class'."""
        self._builtins()
        if spec in self._classes:
            return self._classes[spec]
        if "." in spec or ":" in spec:
            try:
                return import_target(spec)  # type: ignore[no-any-return]
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load {self.what} {spec!r}: {e}") from None
        raise ValueError(f"unknown {self.what} {spec!r}; known: {', '.join(self.names())} "
                         "(or an import path 'package.module:Class')")
