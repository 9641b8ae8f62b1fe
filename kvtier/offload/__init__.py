"""Offload and promotion between a store's top tier and the tiers under it: the Offloader (offloader.py) and the
offload policies it asks, registered by name (policies.py)."""

from typing import Any

from kvtier.offload.policies import OffloadPolicy, known_offloads, offload_policy, register_offload

__all__ = ["Emit", "OffloadPolicy", "Offloader", "Sightings", "known_offloads", "offload_policy", "register_offload",
           "write_down"]


def __getattr__(name: str) -> Any:
    # The Offloader's module imports the block and tier code (torch): loaded on first use, so validating a config
    # (which asks the policies' names) stays light.
    if name in ("Emit", "Offloader", "Sightings", "write_down"):
        from kvtier.offload import offloader

        return getattr(offloader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
