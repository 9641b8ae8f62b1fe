"""Offload policies: when a block goes from the store's top tier (host DRAM) to a tier under it (a pool, the SSD),
one class each, registered by name (``register_offload``) as eviction policies are (kvtier/policies/registry.py).
The Offloader (offloader.py) asks its policy; ``ssd_offload`` and ``pool_offload`` name one. A new policy is one
class and one registration, in kvtier or outside it (registered before the config naming it is loaded).

    write_through  every block put into DRAM is also queued below (the put waits for staging memory, so under
                   sustained load puts run at the lower tier's speed: that is what write-through means)
    on_evict       a block goes down when DRAM evicts it, unless the lower tier holds it already; a block a
                   prefetch brings up leaves a private lower tier (the two hold distinct blocks)
    second_hit     like on_evict, but only blocks seen at least twice (a put and a hit, or put again after it
                   was dropped): one-shot blocks, such as a subagent's private suffix, never cost a write
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REGISTRY: dict[str, type[OffloadPolicy]] = {}


class OffloadPolicy:
    """When blocks go down. The base rule, every policy's on eviction: a block the lower tier lacks goes down when
    it leaves the top tier (evicted, or refused by it), and on close."""

    name = ""
    when = "on eviction"  # how a log line says when blocks go down
    on_put = False  # every block put into the top tier is also queued below, the put waiting for staging memory
    moves_up = False  # a block a prefetch brings up leaves a private lower tier (offloader.Offloader.prefetched)
    counts_sightings = False  # reads the store's record of puts and hits (offloader.Sightings)
    skipped = "skipped_by_policy"  # the Offloader's counter of blocks ``due`` passed over

    def due(self, keys: Sequence[bytes], lacking: Sequence[int], seen: Callable[[], list[int]]) -> list[int]:
        """Of ``keys``, leaving the top tier, the positions to write down: ``lacking``, those the lower tier does
        not hold; ``seen()``, how often each was put or hit recently (asked only if needed)."""
        return list(lacking)

    def __str__(self) -> str:
        return self.name


def register_offload(name: str) -> Callable[[type[OffloadPolicy]], type[OffloadPolicy]]:
    """Class decorator: make an OffloadPolicy subclass known as ``name`` (ValueError if the name is taken by
    another class)."""
    def deco(cls: type[OffloadPolicy]) -> type[OffloadPolicy]:
        if not (isinstance(cls, type) and issubclass(cls, OffloadPolicy)):
            raise TypeError(f"offload policy {name!r}: {cls!r} is not an OffloadPolicy subclass")
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"offload policy {name!r} is registered already ({_REGISTRY[name].__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def known_offloads() -> list[str]:
    return sorted(_REGISTRY)


def offload_policy(name: str | OffloadPolicy) -> OffloadPolicy:
    """The policy registered as ``name`` (an OffloadPolicy passes through); ValueError naming the known ones."""
    if isinstance(name, OffloadPolicy):
        return name
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown offload policy {name!r}; known: {', '.join(known_offloads())}")
    return cls()


@register_offload("write_through")
class WriteThrough(OffloadPolicy):
    when = "on every put"
    on_put = True


@register_offload("on_evict")
class OnEvict(OffloadPolicy):
    moves_up = True


@register_offload("second_hit")
class SecondHit(OffloadPolicy):
    when = "on a second hit"
    counts_sightings = True
    skipped = "skipped_seen_once"

    def due(self, keys: Sequence[bytes], lacking: Sequence[int], seen: Callable[[], list[int]]) -> list[int]:
        counts = seen()
        return [i for i in lacking if counts[i] >= 2]
