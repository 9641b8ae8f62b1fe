"""What every config section is made of: ConfigError, the field helpers and the checks sections share.

A field's metadata is what ``kvtier config`` prints and what the loader coerces by: ``help``, ``choices`` (the
values allowed, checked by ``Config.validate`` for every section's fields) and ``kind`` (bytes, switch; else
the field's type). The documentation's configuration table is rendered from the same metadata at build time
(docs/gen_config.py), so a key's help is written once, here. Pure functions; importing this module imports no tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any

from kvtier.units import parse_bytes
from kvtier.wire.pool import ENDPOINT_SCHEMES

# (key, its value, the bytes it must hold at least): a size that depends on the block, known with the layout.
BlockSize = tuple[str, int, int]


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


def mapping_field(help: str) -> Any:
    """A key whose value is a table (a dict, a TOML table, or JSON text in a KVTIER_* variable); empty by default."""
    return field(default_factory=dict, metadata={"kind": "mapping", "help": help, "default_text": "{}"})


def bytes_field(default: int | str, help: str) -> Any:
    """A size key: written as bytes or "64GiB" (kvtier.units.parse_bytes), held as an int; the default as written
    is kept for the documentation's table (``default_text``)."""
    return field(default=parse_bytes(default), metadata={"kind": "bytes", "help": help, "default_text": str(default)})


def key_field(default: Any, help: str, choices: tuple[str, ...] = (), kind: str = "") -> Any:
    metadata: dict[str, Any] = {"help": help, "choices": choices}
    if kind:
        metadata["kind"] = kind
    return field(default=default, metadata=metadata)


def switch_field(default: str, help: str) -> Any:
    """auto, true or false; any boolean word (or a JSON boolean) is read as true/false."""
    return key_field(default, help, ("auto", "true", "false"), kind="switch")


def check_range(key: str, value: float, low: float, high: float, note: str = "") -> None:
    """ConfigError ``<key> must be in low..high[ note], got value`` unless low <= value <= high."""
    if not low <= value <= high:
        raise ConfigError(f"{key} must be in {low}..{high}{note}, got {value}")


def check_positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


def endpoint_list(key: str, value: str) -> list[str]:
    """The comma-separated endpoints of ``value``, blanks dropped; ConfigError naming ``key`` for one that is
    not tcp:// or ipc:// (ENDPOINT_SCHEMES: a zmq connect would fail on it only when the tier is built, in the
    workers)."""
    endpoints = [e.strip() for e in value.split(",") if e.strip()]
    bad = [e for e in endpoints if not e.startswith(ENDPOINT_SCHEMES)]
    if bad:
        raise ConfigError(f"{key}: {bad[0]!r} is not a tcp://host:port or ipc:///path endpoint")
    return endpoints


def check_offload_name(key: str, name: Any) -> None:
    """ConfigError naming ``key`` unless ``name`` is a registered offload policy (kvtier/offload/policies.py:
    write_through, on_evict, second_hit, or one registered before the config is loaded)."""
    from kvtier.offload.policies import known_offloads  # here: importing config must stay light

    if name not in known_offloads():
        raise ConfigError(f"{key}: {name!r} is not one of {', '.join(known_offloads())}")


def check_transport_name(key: str, name: Any, endpoints: Sequence[str]) -> None:
    """ConfigError naming ``key`` unless ``name`` is auto or a registered pool transport (kvtier/transport/
    registry.py: shm, rdma, stream, tcp, or one registered before the config is loaded), and one that maps the
    pool's memory (shm) is given only pools on this host (ipc:// endpoints)."""
    if name == "auto":
        return
    from kvtier.transport.registry import known_transports, transport  # here: importing config must stay light

    if name not in known_transports():
        raise ConfigError(f"{key}: {name!r} is not one of auto, {', '.join(known_transports())}")
    remote = [e for e in endpoints if not e.startswith("ipc://")]
    if transport(name).maps_memory and remote:
        raise ConfigError(f"{key}: {name!r} maps a pool on this host, reached at an ipc:///path endpoint; pool lists "
                          f"{remote[0]!r} (use auto or a transport that crosses hosts for it)")


def check_policy_name(key: str, spec: Any) -> None:
    """ConfigError naming ``key``, ``spec`` and the known policies unless ``spec`` names an eviction policy (a
    registered name, ``default``, or an import path 'package.module:Class' that imports)."""
    from kvtier.policies import known_policies, policy_class  # here: importing config must stay light

    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{key}: expected an eviction policy name, got {spec!r}; known: "
                          f"{', '.join(known_policies())} (or an import path 'package.module:Class')")
    try:
        cls = policy_class(spec)
    except ValueError as e:  # the registry's message names the known policies, or why an import path failed
        raise ConfigError(f"{key}: {e}") from None
    if not callable(cls):
        raise ConfigError(f"{key}: {spec!r} is not a policy class (got a {type(cls).__name__})")
