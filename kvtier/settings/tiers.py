"""The tiers a store stacks, one table: each kind of tier by name, its place in the order, the function that builds
it from a Config, and what an engine calls a hit from it. ``TieredStore.from_config`` walks this table top first
(kvtier/store/build.py); a new tier is one module and one ``register_tier`` call, in kvtier or in a module of your
own imported before the config is loaded.

    name   order  built when                          settings                  an engine's hit source
    dram   0      dram_capacity (standalone: its own) Config's dram_* keys      host
    pool   100    mode standalone or distributed      pool, master, pool_*      host (standalone), p2p
    ssd    200    ssd_path is set                     ssd_* keys                disk
    (yours)       it is named under the ``tiers`` key its section there         as registered

A built-in tier's settings are Config's own keys (kvtier/settings/dram.py, ssd.py, pool.py). A registered tier
takes its settings from the ``tiers`` key, ``{"<name>": {...}}``, checked by its ``check`` when the config is
loaded (so a mistake fails at load, not in a worker) and handed to its ``build``. Pure data: importing this module
imports no tier; a built-in builder is named "package.module:function" and imported when a store is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.registry import import_target
from kvtier.settings.base import ConfigError

HIT_SOURCES = ("host", "p2p", "disk", "external")  # vLLM's CacheHitSource names; external: none of these


@dataclass(frozen=True)
class StackedTier:
    """A built tier with what the store needs to stack it: the offload policy that moves blocks from the top tier
    into it (a registered name, kvtier/offload/policies.py) and whether what it serves is promoted to the top."""

    tier: Any  # a kvtier.tiers.base.Tier
    offload: str = "on_evict"
    promote: bool = True


@dataclass(frozen=True)
class TierSpec:
    """One kind of tier. ``build(cfg, section, block)``: the StackedTier ``cfg`` describes, or None when it
    describes none (``section``: the tier's settings under ``tiers``, {} for a built-in; ``block``: a TierBlock).
    ``check(section)``: ConfigError for bad settings of a registered tier (None: a built-in, configured by
    Config's own keys and never named under ``tiers``). ``hit_source``: one of HIT_SOURCES, or a function of the
    Config giving it."""

    name: str
    order: int  # place in the stack, top first: built-ins at 0, 100, 200
    build: str | Callable[[Any, Mapping[str, Any], TierBlock], StackedTier | None]
    check: Callable[[Mapping[str, Any]], None] | None = None
    hit_source: str | Callable[[Any], str] = "external"

    @property
    def registered(self) -> bool:
        """Configured under ``tiers`` (stacked only where named there), not by Config's own keys."""
        return self.check is not None

    def builder(self) -> Callable[[Any, Mapping[str, Any], TierBlock], StackedTier | None]:
        if callable(self.build):
            return self.build
        return import_target(self.build)  # type: ignore[no-any-return]

    def source(self, cfg: Any) -> str:
        return self.hit_source(cfg) if callable(self.hit_source) else self.hit_source


@dataclass(frozen=True)
class TierBlock:
    """What a tier is built for, known once the layout is: the block size, the layout's fingerprint (a tier that
    persists blocks refuses files of another layout; "" for a plain size), the dtypes its blocks hold, and the
    clock the store's policies read (None: time.monotonic)."""

    block_bytes: int
    fingerprint: str = ""
    dtypes: tuple[str, ...] = ()
    clock: Callable[[], float] | None = None


_TABLE: dict[str, TierSpec] = {}


def register_tier(spec: TierSpec) -> TierSpec:
    """Add ``spec`` to the table (ValueError if its name is taken by another spec, or its order by another tier:
    the stack's order must be one answer)."""
    if spec.name in _TABLE and _TABLE[spec.name] != spec:
        raise ValueError(f"tier {spec.name!r} is registered already")
    clash = [s.name for s in _TABLE.values() if s.order == spec.order and s.name != spec.name]
    if clash:
        raise ValueError(f"tier {spec.name!r}: order {spec.order} is {clash[0]!r}'s already")
    if not callable(spec.hit_source) and spec.hit_source not in HIT_SOURCES:
        raise ValueError(f"tier {spec.name!r}: hit_source {spec.hit_source!r} is not one of {', '.join(HIT_SOURCES)}")
    _TABLE[spec.name] = spec
    return spec


def tier_specs() -> list[TierSpec]:
    """Every registered kind of tier, top of the stack first."""
    return sorted(_TABLE.values(), key=lambda s: s.order)


def tier_spec(name: str) -> TierSpec | None:
    return _TABLE.get(name)


def check_tier_sections(key: str, sections: Mapping[str, Any]) -> None:
    """ConfigError naming ``key`` unless every name in ``sections`` is a registered (not built-in) tier whose
    section is a mapping its ``check`` accepts."""
    if not isinstance(sections, Mapping):
        raise ConfigError(f"{key}: expected {{tier name: {{its settings}}}}, got {type(sections).__name__}")
    registered = [s.name for s in tier_specs() if s.registered]
    for name, section in sections.items():
        spec = _TABLE.get(name)
        if spec is None or spec.check is None:
            why = "a built-in tier, set by its own keys" if spec is not None else "not a registered tier"
            raise ConfigError(f"{key}: {name!r} is {why}; registered: {', '.join(registered) or 'none'} "
                              "(kvtier.settings.tiers.register_tier)")
        if not isinstance(section, Mapping):
            raise ConfigError(f"{key}: {name}: expected a table of its settings, got {type(section).__name__}")
        try:
            spec.check(section)
        except ConfigError as e:
            raise ConfigError(f"{key}: {name}: {e}") from None


register_tier(TierSpec("dram", 0, "kvtier.store.build:dram_tier", hit_source="host"))
register_tier(TierSpec("pool", 100, "kvtier.store.build:pool_tier",
                       hit_source=lambda cfg: "host" if cfg.mode == "standalone" else "p2p"))  # the node pool: DRAM
register_tier(TierSpec("ssd", 200, "kvtier.store.build:ssd_tier", hit_source="disk"))
