"""The real-engine tests (a package, so that its conftest and helpers never shadow tests/conftest.py's module
name ``conftest``, which the other test modules import from)."""
