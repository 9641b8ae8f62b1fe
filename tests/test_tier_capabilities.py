"""Tier capabilities are declared (kvtier.tiers.base), never probed: the store and its offloaders go by what a
tier's class says it is, checked once when they are built."""

from typing import Any

import pytest

from conftest import blocks_for
from kvtier import Namespace, TieredStore
from kvtier.offload import Offloader
from kvtier.tiers.base import AddressableSlots, RemoteTier, Tier, WriteBehindStaging
from kvtier.tiers.dram import DramTier
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.ssd import DiskTier

BB = 4096
KEYS = Namespace("caps").keys(range(8))


class Undeclared:
    """A DramTier behind delegation: it answers every method of one, but its class declares nothing."""

    def __init__(self, inner: DramTier) -> None:
        self._inner = inner
        self.name, self.block_bytes = inner.name, inner.block_bytes

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


def test_each_tier_declares_what_it_can_do():
    assert issubclass(DramTier, AddressableSlots) and not issubclass(DramTier, WriteBehindStaging)
    assert issubclass(DiskTier, WriteBehindStaging) and not issubclass(DiskTier, AddressableSlots | RemoteTier)
    assert issubclass(PoolTier, WriteBehindStaging) and issubclass(PoolTier, RemoteTier)
    assert not issubclass(PoolTier, AddressableSlots)
    assert not issubclass(DramTier, RemoteTier) and not issubclass(DiskTier, RemoteTier)


def test_a_top_tier_that_declares_no_slots_gets_no_in_place_writes_even_if_it_has_the_methods():
    inner = DramTier(4 * BB, BB)
    tier = Undeclared(inner)
    assert isinstance(tier, Tier) and callable(tier.reserve) and callable(tier.acquire)  # probing would say yes
    store = TieredStore([tier])
    try:
        assert store.put(KEYS[:2], blocks_for(KEYS[:2], BB)).stored == 2
        assert not store.writes_in_place
        with pytest.raises(TypeError, match="no addressable slots"):
            store.put_in_place(KEYS[2:3], lambda index, slots: None)
        with store.borrow(KEYS[:2]) as addresses:
            assert addresses == [None, None]  # not lent in place: the caller gets them
    finally:
        store.close()


def test_the_declared_dram_tier_lends_its_slots():
    store = TieredStore([DramTier(4 * BB, BB)])
    try:
        store.put(KEYS[:2], blocks_for(KEYS[:2], BB))
        assert store.writes_in_place
        with store.borrow(KEYS[:3]) as addresses:
            assert addresses[0] is not None and addresses[1] is not None and addresses[2] is None
    finally:
        store.close()


def test_an_offloader_writes_through_a_lower_tier_that_declares_no_staging_with_put(tmp_path):
    """A lower tier with a put_later it does not declare is written with put (no write-behind assumed)."""
    top = DramTier(4 * BB, BB)
    disk = DiskTier(str(tmp_path), 16 * BB, BB, segment_bytes=8 * BB, staging_bytes=8 * BB)
    try:
        lower = Undeclared.__new__(Undeclared)
        lower._inner, lower.name, lower.block_bytes = disk, disk.name, disk.block_bytes
        puts = []
        lower.put = lambda keys, blocks: puts.append(list(keys)) or disk.put(keys, blocks)  # type: ignore[method-assign]
        offload = Offloader(top, lower, "write_through")
        top.put(KEYS[:2], blocks_for(KEYS[:2], BB))
        from kvtier.blocks import block_rows

        offload.after_put(KEYS[:2], block_rows(blocks_for(KEYS[:2], BB), 2, BB))
        assert puts == [KEYS[:2]] and disk.contains(KEYS[:2]) == [True, True]
        assert offload.flush(0) is True  # nothing staged: nothing to wait for
    finally:
        disk.close()
        top.close()
