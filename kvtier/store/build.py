"""A TieredStore's parts: which tiers a Config describes (with each lower tier's offload policy and promote
switch), and the offloaders between the top tier and each lower one.

The half of TieredStore's construction that knows which tiers a mode stacks and offload/'s pieces (the store
itself composes whatever it is given): where a new tier's keys meet the store, each tier's arguments asked of
its config section (kvtier/settings/: ``cfg.dram_args``, ``cfg.ssd_args``, ``cfg.pool_args``). Assembly only, in the caller's
thread; building a tier may open its files or connect its pool, and what is built here is owned by the store
given it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.config import Config
from kvtier.layout import BlockLayout
from kvtier.offload import Emit, OffloadPolicy, Offloader, Sightings, offload_policy
from kvtier.policies import Clock
from kvtier.tiers.base import Tier


@dataclass
class StoreParts:
    """What TieredStore takes from a Config: ``tiers`` top first; ``offload`` and ``promote`` per lower tier."""

    tiers: list[Tier] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)
    promote: list[bool] = field(default_factory=list)
    dtypes: tuple[str, ...] = ()


def tiers_from_config(cfg: Config, layout: BlockLayout | int, clock: Clock | None) -> StoreParts:
    """The tiers of ``cfg``'s mode for blocks of ``layout`` (or a plain block size in bytes); ConfigError for a
    block size no tier can hold, before any tier is built."""
    block_bytes = layout if isinstance(layout, int) else layout.nbytes
    cfg.check_block_bytes(block_bytes)  # every size that holds no block fails before any tier is built
    dtypes = () if isinstance(layout, int) else tuple({g.dtype for g in layout.groups})
    parts = StoreParts(dtypes=dtypes)
    dram_capacity = cfg.private_dram_capacity
    if dram_capacity:
        from kvtier.tiers.dram import DramTier

        # Admission (a full DRAM declining a put's blocks: Config.dram_admits): above a lower tier a declined
        # block goes down as its eviction would (each lower tier's offload policy, then that tier's own policy,
        # decide: writes.TopWrites).
        parts.tiers.append(DramTier(**cfg.dram_args(dram_capacity, block_bytes, dtypes, clock, cfg.dram_admits)))
    if cfg.mode != "embedded":
        from kvtier.tiers.pool import PoolTier

        parts.tiers.append(PoolTier.from_config(cfg, block_bytes, dtypes))
        parts.offload.append(cfg.pool_offload)
        parts.promote.append(cfg.pool_promotes)
    if cfg.ssd_path:
        from kvtier.tiers.ssd import DiskTier

        fingerprint = "" if isinstance(layout, int) else layout.fingerprint
        parts.tiers.append(DiskTier(**cfg.ssd_args(block_bytes, fingerprint, dtypes, clock)))
        parts.offload.append(cfg.ssd_offload)
        parts.promote.append(cfg.ssd_promote)
    if not dram_capacity:
        # the pool is the top tier: nothing above it offloads into it (or promotes out of it)
        parts.offload, parts.promote = parts.offload[1:], parts.promote[1:]
    return parts


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
