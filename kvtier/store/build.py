"""A TieredStore's parts: the tiers a Config describes (with each lower tier's offload policy and promote
switch), and the offloaders between the top tier and each lower one.

The half of TieredStore's construction that knows the tier table (kvtier/settings/tiers.py: which kinds of tier
there are, in which order, each built by its function) and offload/'s pieces (the store itself composes whatever it
is given). The built-in tiers' builders are here, each asking its config section for its arguments
(kvtier/settings/: ``cfg.dram_args``, ``cfg.ssd_args``, ``cfg.pool_args``). Assembly only, in the caller's thread;
building a tier may open its files or connect its pool, and what is built here is owned by the store given it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import Config
from kvtier.layout import BlockLayout
from kvtier.offload import Emit, OffloadPolicy, Offloader, Sightings, offload_policy
from kvtier.policies import Clock
from kvtier.settings.tiers import StackedTier, TierBlock, tier_specs
from kvtier.tiers.base import Tier


@dataclass
class StoreParts:
    """What TieredStore takes from a Config: ``tiers`` top first; ``offload`` and ``promote`` per lower tier."""

    tiers: list[Tier] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)
    promote: list[bool] = field(default_factory=list)
    dtypes: tuple[str, ...] = ()


def tiers_from_config(cfg: Config, layout: BlockLayout | int, clock: Clock | None) -> StoreParts:
    """The tiers ``cfg`` describes for blocks of ``layout`` (or a plain block size in bytes), in the order of the
    tier table (kvtier/settings/tiers.py); ConfigError for a block size no tier can hold, before any tier is
    built. A tier that fails to build closes the ones built before it."""
    block_bytes = layout if isinstance(layout, int) else layout.nbytes
    cfg.check_block_bytes(block_bytes)  # every size that holds no block fails before any tier is built
    dtypes = () if isinstance(layout, int) else tuple({g.dtype for g in layout.groups})
    block = TierBlock(block_bytes, "" if isinstance(layout, int) else layout.fingerprint, dtypes, clock)
    parts = StoreParts(dtypes=dtypes)
    try:
        for spec in tier_specs():
            if spec.registered and spec.name not in cfg.tiers:
                continue  # a registered tier is stacked where the config names it, with its settings
            stacked = spec.builder()(cfg, cfg.tiers.get(spec.name, {}), block)
            if stacked is not None:
                parts.tiers.append(stacked.tier)
                parts.offload.append(stacked.offload)
                parts.promote.append(stacked.promote)
    except BaseException:
        for tier in parts.tiers:
            tier.close()
        raise
    # the top tier: nothing above it offloads into it (or promotes out of it)
    parts.offload, parts.promote = parts.offload[1:], parts.promote[1:]
    return parts


# The built-in tiers' builders (named in kvtier/settings/tiers.py, imported when a store is built): each reads its
# arguments from its section of Config (``cfg.dram_args``, ``cfg.pool_args``, ``cfg.ssd_args``).

def dram_tier(cfg: Config, _section: Mapping[str, Any], block: TierBlock) -> StackedTier | None:
    capacity = cfg.private_dram_capacity
    if not capacity:
        return None
    from kvtier.tiers.dram import DramTier

    # Admission (a full DRAM declining a put's blocks: Config.dram_admits): above a lower tier a declined block
    # goes down as its eviction would (each lower tier's offload policy, then that tier's own policy, decide:
    # writes.TopWrites).
    return StackedTier(DramTier(**cfg.dram_args(capacity, block.block_bytes, block.dtypes, block.clock,
                                                cfg.dram_admits)))


def pool_tier(cfg: Config, _section: Mapping[str, Any], block: TierBlock) -> StackedTier | None:
    if cfg.mode == "embedded":
        return None
    from kvtier.tiers.pool import PoolTier

    return StackedTier(PoolTier.from_config(cfg, block.block_bytes, block.dtypes), cfg.pool_offload,
                       cfg.pool_promotes)


def ssd_tier(cfg: Config, _section: Mapping[str, Any], block: TierBlock) -> StackedTier | None:
    if not cfg.ssd_path:
        return None
    from kvtier.tiers.ssd import DiskTier

    return StackedTier(DiskTier(**cfg.ssd_args(block.block_bytes, block.fingerprint, block.dtypes, block.clock)),
                       cfg.ssd_offload, cfg.ssd_promote)


def offloads_between(tiers: Sequence[Tier], offload: str | OffloadPolicy | Sequence[str | OffloadPolicy],
                     promote: bool | Sequence[bool], emit: Emit) -> tuple[list[Offloader], Sightings | None]:
    """One Offloader from ``tiers[0]`` to each lower tier, in order, and the Sightings they share (None unless some
    policy counts sightings: second_hit). ``offload`` (policies or their registered names), ``promote``: one
    answer for every lower tier, or one per lower tier in order (a pool's, the SSD's); ValueError for a count
    that does not match, or an unknown policy."""
    one = isinstance(offload, (str, OffloadPolicy))
    policies = [offload_policy(p) for p in ([offload] * (len(tiers) - 1) if one else offload)]
    if len(policies) != len(tiers) - 1:
        raise ValueError(f"{len(tiers) - 1} lower tiers but {len(policies)} offload policies")
    promotes = [promote] * len(policies) if isinstance(promote, bool) else list(promote)
    if len(promotes) != len(policies):
        raise ValueError(f"{len(policies)} lower tiers but {len(promotes)} promote switches")
    sightings = (Sightings(4 * tiers[0].stats().capacity_bytes // tiers[0].block_bytes)
                 if any(p.counts_sightings for p in policies) else None)
    offloads = [Offloader(tiers[0], lower, policy, promote=up, emit=emit, sightings=sightings, index=i)
                for i, (lower, policy, up) in enumerate(zip(tiers[1:], policies, promotes), 1)]
    return offloads, sightings
