"""DiskTier on real files: bit-exact I/O, O_DIRECT, capacity and eviction, warm restart, damaged files."""

import logging
import os

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bytecheck import assert_all_hits_exact, assert_no_wrong_bytes
from conftest import blocks_for
from kvtier.iothreads import IoThreads
from kvtier.keys import Namespace
from kvtier.pins import PinTable
from kvtier.tiers.ssd import DirectoryInUse, DiskTier
from kvtier.tiers.ssd.io import ALIGN, aligned_blocks, probe_direct_io
from ssd_helpers import mounted, open_tier

BB = 16384


def test_tmp_path_is_a_real_disk_with_o_direct(tmp_path):
    reason = probe_direct_io(tmp_path)
    if reason:
        pytest.skip(f"the test temp dir cannot do O_DIRECT ({reason}); the SSD tests then cover buffered I/O only")
    t = open_tier(tmp_path, 8, BB)
    assert t.direct and t.stats().extra["direct_io"] is True
    t.close()


@pytest.mark.parametrize("aligned", [True, False])
def test_put_get_bit_exact_aligned_and_bounced(tmp_path, make_keys, aligned):
    t = open_tier(tmp_path, 32, BB)
    keys = make_keys(20)
    data = blocks_for(keys, BB)
    src = aligned_blocks(20, BB) if aligned else torch.empty(20 * BB + 64, dtype=torch.uint8)[64:].view(20, BB)
    src.copy_(data)
    assert t.put(keys, src) == [True] * 20
    out = aligned_blocks(20, BB) if aligned else torch.zeros(20 * BB + 8, dtype=torch.uint8)[8:].view(20, BB)
    assert_all_hits_exact(t.get(keys, out), out, data)
    outs = [np.zeros(BB, np.uint8) for _ in range(3)]  # a list of separate buffers
    assert t.get(keys[5:8], outs) == [True] * 3
    assert all(np.array_equal(o, data[5 + i].numpy()) for i, o in enumerate(outs))
    s = t.stats()
    assert (s.blocks, s.puts, s.hits) == (20, 20, 23)
    t.close()


def test_block_not_a_multiple_of_the_alignment_is_padded(tmp_path, make_keys):
    bb = 3000  # O_DIRECT needs 4 KiB slots: each block is padded, capacity counts slots
    t = DiskTier(tmp_path, 10 * ALIGN, bb, segment_bytes=4 * ALIGN)
    t.attach(PinTable(), None)
    keys = make_keys(12)
    data = blocks_for(keys, bb)
    assert t.slot_bytes == (ALIGN if t.direct else bb)
    assert t.put(keys[:8], data[:8]) == [True] * 8
    assert t.put(keys[8:], data[8:]) == [True] * 4  # evicts two
    out = torch.zeros(12, bb, dtype=torch.uint8)
    hit = t.get(keys, out)
    assert sum(hit) == t.stats().blocks == 10 and hit[8:] == [True] * 4
    assert_no_wrong_bytes(hit, out, data)
    t.close()


def test_wrong_sizes_are_clear_errors(tmp_path, make_keys):
    t = open_tier(tmp_path, 8, BB)
    keys = make_keys(2)
    with pytest.raises(ValueError, match=f"expected {BB} bytes per block"):
        t.put(keys, torch.zeros(2, BB // 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="read-only"):
        t.get(keys, [bytes(BB), bytes(BB)])
    assert t.stats().blocks == 0
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(tmp_path / "small", BB - 1, BB)
    t.close()


def test_capacity_eviction_and_pins(tmp_path, make_keys):
    pins = PinTable()
    evicted = []
    t = open_tier(tmp_path, 8, BB, pins=pins, on_evict=lambda keys, views: evicted.extend(keys))
    keys = make_keys(20)
    data = blocks_for(keys, BB)
    t.put(keys[:8], data[:8])
    pins.pin(keys[:2])
    assert t.put(keys[8:14], data[8:14]) == [True] * 6
    assert evicted == keys[2:8]  # LRU, skipping the pinned
    assert t.put(keys[14:20], data[14:20]) == [True] * 6  # evicts 8..13, never 0..1
    pins.pin(keys[14:20])
    assert t.put(keys[8:9], data[8:9]) == [False]  # every block pinned: refused, not over capacity
    s = t.stats()
    assert s.used_bytes <= s.capacity_bytes == 8 * BB and s.rejected == 1
    held = t.contains(keys)
    assert held[:2] == [True, True] and all(held[14:20]) and sum(held) == 8
    seg_bytes = sum(p.stat().st_size for p in tmp_path.glob("seg-*.dat"))
    assert seg_bytes <= 8 * BB  # bytes on disk, not only the accounting
    t.close()


def test_warm_restart_serves_what_was_there(tmp_path, make_keys):
    t = open_tier(tmp_path, 16, BB)
    keys = make_keys(16)
    data = blocks_for(keys, BB)
    t.put(keys[:6], data[:6])
    t.put(keys[6:10], data[6:10])
    t.close()
    t = open_tier(tmp_path, 12, BB)  # reopened with less capacity
    assert t.stats().extra["restored"] == t.stats().blocks == 10
    t.put(keys[10:16], data[10:16])  # 2 free slots, so 4 evicted: the oldest writes (order survives)
    assert t.contains(keys) == [False] * 4 + [True] * 12
    t.close()
    t = open_tier(tmp_path, 12, BB)
    out = torch.zeros(16, BB, dtype=torch.uint8)
    assert t.get(keys, out) == [False] * 4 + [True] * 12
    assert torch.equal(out[4:], data[4:])
    t.close()


def test_directory_is_locked_against_a_second_store(tmp_path):
    t = open_tier(tmp_path, 4, BB)
    with pytest.raises(DirectoryInUse, match="in use"):
        DiskTier(tmp_path, 4 * BB, BB)
    t.close()
    open_tier(tmp_path, 4, BB).close()  # released on close


def test_other_geometry_starts_empty(tmp_path, make_keys, caplog):
    keys = make_keys(4)
    t = open_tier(tmp_path, 8, BB, fingerprint="layout-a")
    t.put(keys, blocks_for(keys, BB))
    t.close()
    with caplog.at_level(logging.WARNING):
        t = open_tier(tmp_path, 8, BB, fingerprint="layout-b")
    assert t.contains(keys) == [False] * 4 and "starting empty" in caplog.text
    t.close()


def _segment_of(t, key):
    return t._files.path(t._files.place(t._slot_of[key])[0])


def test_deleted_and_truncated_segment_files_become_misses(tmp_path, make_keys):
    t = open_tier(tmp_path, 16, BB)  # 4 blocks per segment file
    keys = make_keys(16)
    data = blocks_for(keys, BB)
    t.put(keys, data)
    gone = _segment_of(t, keys[0])
    cut = _segment_of(t, keys[4])
    assert gone != cut
    t.close()
    gone.unlink()
    os.truncate(cut, 2 * BB)  # keeps the first two slots of that segment
    t = open_tier(tmp_path, 16, BB)
    out = torch.zeros(16, BB, dtype=torch.uint8)
    hit = t.get(keys, out)
    assert sum(hit) == 16 - 4 - 2
    assert_no_wrong_bytes(hit, out, data)
    extra = t.stats().extra
    assert extra["dropped_at_open_segment_file_missing"] == 4 and extra["dropped_at_open_segment_file_truncated"] == 2
    assert t.put(keys, data) == [True] * 16  # the files are recreated / extended on the next write
    assert_all_hits_exact(t.get(keys, out), out, data)
    t.close()


def test_segment_damaged_while_open(tmp_path, make_keys):
    gone = []  # what the store's eviction listener hears: it turns these into "removed" events
    t = open_tier(tmp_path, 8, BB, on_evict=lambda keys, views: gone.extend(keys))
    keys = make_keys(8)
    data = blocks_for(keys, BB)
    t.put(keys, data)
    os.truncate(_segment_of(t, keys[4]), BB)  # truncated under a running tier: short reads are misses
    out = torch.zeros(8, BB, dtype=torch.uint8)
    hit = t.get(keys[4:8], out[4:8])
    assert hit == [True, False, False, False] and torch.equal(out[4], data[4])
    assert t.stats().extra["short_reads"] == 3 and t.contains(keys[5:8]) == [False] * 3
    assert gone == keys[5:8]
    _segment_of(t, keys[0]).unlink()  # deleted: still readable through our descriptor, dropped by check()
    assert t.check() == 4
    assert t.contains(keys[:4]) == [False] * 4
    assert sorted(gone) == sorted(keys[:4] + keys[5:8])
    t.close()


def _flip_byte(t, key, at):
    """Corrupt one byte of ``key``'s block in its segment file, behind the tier's back."""
    _, offset = t._files.place(t._slot_of[key])
    fd = os.open(_segment_of(t, key), os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset + at)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_corrupted_bytes_are_a_counted_miss_never_data(tmp_path, make_keys):
    gone = []
    t = open_tier(tmp_path, 8, BB, on_evict=lambda keys, views: gone.extend(keys))
    keys = make_keys(4)
    data = blocks_for(keys, BB)
    t.put(keys, data)
    # Once through a direct read into aligned rows, once through the bounce buffer (unaligned rows).
    for out in (aligned_blocks(4, BB), torch.full((4, BB), 7, dtype=torch.uint8)[:, :].contiguous()):
        _flip_byte(t, keys[1], BB // 2)
        hit = t.get(keys, out)
        assert hit == [True, False, True, True]
        assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[2])
        assert not torch.equal(out[1], data[1])  # the corrupted bytes were never handed out as the block
        assert t.contains(keys[1:2]) == [False] and gone[-1:] == keys[1:2]  # dropped, and the store is told
        assert t.put(keys[1:2], data[1:2]) == [True]
        out2 = torch.zeros(1, BB, dtype=torch.uint8)
        assert_all_hits_exact(t.get(keys[1:2], out2), out2[0], data[1])
    assert t.stats().extra["checksum_failures"] == 2 and gone == [keys[1]] * 2
    t.close()


def test_corruption_found_after_restart(tmp_path, make_keys):
    t = open_tier(tmp_path, 8, BB)
    keys = make_keys(3)
    data = blocks_for(keys, BB)
    t.put(keys, data)
    _flip_byte(t, keys[2], 0)
    t.close()
    t = open_tier(tmp_path, 8, BB)
    out = torch.zeros(3, BB, dtype=torch.uint8)
    assert t.get(keys, out) == [True, True, False] and torch.equal(out[:2], data[:2])
    assert t.stats().extra["checksum_failures"] == 1
    t.close()
    t = open_tier(tmp_path, 8, BB)  # the drop was durable
    assert t.contains(keys) == [True, True, False]
    t.close()


def test_tmpfs_fallback_warns_once(tmp_path, make_keys, caplog):
    """ramfs has no O_DIRECT (tmpfs gained it in Linux 6.6, so this machine's tmpfs may not fall back)."""
    with mounted("ramfs", tmp_path / "ram") as where:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.ssd"):
            t = open_tier(where, 8, BB)
            keys = make_keys(6)
            data = blocks_for(keys, BB)
            t.put(keys, data)
            out = torch.zeros(6, BB, dtype=torch.uint8)
            assert_all_hits_exact(t.get(keys, out), out, data)
            t.close()
        assert not t.direct
        warnings = [r for r in caplog.records if "no O_DIRECT" in r.getMessage()]
        assert len(warnings) == 1
        with pytest.raises(OSError, match="cannot do O_DIRECT"):
            DiskTier(where / "strict", 8 * BB, BB, direct_io="true")


def test_dev_shm_works_either_way(make_keys):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        t = open_tier(d, 8, BB)
        keys = make_keys(3)
        t.put(keys, blocks_for(keys, BB))
        out = torch.zeros(3, BB, dtype=torch.uint8)
        assert_all_hits_exact(t.get(keys, out), out, blocks_for(keys, BB))
        t.close()


def test_write_behind_is_readable_before_it_lands_and_survives_the_source(tmp_path, make_keys):
    t = open_tier(tmp_path, 32, BB, staging_bytes=8 * BB)
    keys = make_keys(24)
    data = blocks_for(keys, BB)
    src = data.clone()
    fut = t.put_later(keys, src, wait=True)  # more than the staging holds: waits for the writer to drain
    src.zero_()  # the caller's buffer is free once put_later returns
    assert sorted(fut.result(10)) == sorted(keys)
    out = torch.zeros(24, BB, dtype=torch.uint8)
    assert_all_hits_exact(t.get(keys, out), out, data)
    assert t.flush(10) and t.stats().extra["staged"] == 0
    t.close()


def test_put_later_without_waiting_drops_what_does_not_fit(tmp_path, make_keys):
    t = open_tier(tmp_path, 64, BB, staging_bytes=4 * BB)
    keys = make_keys(40)
    futs = [t.put_later(keys[i:i + 10], blocks_for(keys[i:i + 10], BB), wait=False) for i in range(0, 40, 10)]
    written = sum(len(f.result(10)) for f in futs)
    s = t.stats()
    assert written == s.blocks and written + s.extra.get("offload_dropped", 0) == 40
    out = torch.zeros(40, BB, dtype=torch.uint8)
    hit = t.get(keys, out)
    assert assert_no_wrong_bytes(hit, out, blocks_for(keys, BB)).hits == written
    t.close()


def test_remove_during_write_behind_wins(tmp_path, make_keys):
    t = open_tier(tmp_path, 16, BB)
    keys = make_keys(8)
    fut = t.put_later(keys, blocks_for(keys, BB), wait=True)
    assert t.remove(keys[:4]) == 4  # staged or written by now: either way held, and gone after
    fut.result(10)
    t.flush(10)
    assert t.contains(keys[:4]) == [False] * 4 and t.contains(keys[4:]) == [True] * 4
    t.close()
    t = open_tier(tmp_path, 16, BB)
    assert t.contains(keys[:4]) == [False] * 4 and t.contains(keys[4:]) == [True] * 4  # the index agrees
    t.close()


class DiskModel(RuleBasedStateMachine):
    """Random put/get/remove/pin/reopen against a dict model; reopen is a warm restart."""

    N, CAP = 12, 5

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="kvtier-ssd-sm-")
        self.keys = Namespace("ssd-sm").keys(range(self.N))
        self.pins = PinTable()
        self.pinned: dict[bytes, int] = {}
        self.model: dict[bytes, bytes] = {}
        self.t = self._open()

    def _open(self):
        return open_tier(self.dir, self.CAP, 4096, pins=self.pins, segment_bytes=2 * 4096, fsync=False,
                         staging_bytes=0)

    def teardown(self):
        import shutil

        self.t.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(idx=st.lists(st.integers(0, N - 1), min_size=1, max_size=4), v=st.integers(0, 255))
    def put(self, idx, v):
        ks = [self.keys[i] for i in idx]
        blocks = [bytes([v ^ i]) * 4096 for i in idx]
        before = {k for k, h in zip(self.keys, self.t.contains(self.keys)) if h}
        held = self.t.put(ks, blocks)
        after = {k for k, h in zip(self.keys, self.t.contains(self.keys)) if h}
        for k, b, h in reversed(list(zip(ks, blocks, held))):
            if h and k not in before:
                self.model[k] = b
        for k in set(self.model) - after:
            del self.model[k]

    @rule(idx=st.lists(st.integers(0, N - 1), min_size=1, max_size=4))
    def get(self, idx):
        ks = [self.keys[i] for i in idx]
        out = [bytearray(4096) for _ in ks]
        for k, h, o in zip(ks, self.t.get(ks, out), out):
            assert h == (k in self.model)
            if h:
                assert bytes(o) == self.model[k]

    @rule(idx=st.lists(st.integers(0, N - 1), min_size=1, max_size=3))
    def remove(self, idx):
        ks = {self.keys[i] for i in idx}
        assert self.t.remove(list(ks)) == len(ks & set(self.model))
        for k in ks:  # pins stay with their holders, as in the store
            self.model.pop(k, None)

    @rule(i=st.integers(0, N - 1))
    def pin(self, i):
        k = self.keys[i]
        if k in self.model and sum(1 for c in self.pinned.values() if c) < self.CAP - 1:
            self.pins.pin([k])
            self.pinned[k] = self.pinned.get(k, 0) + 1

    @precondition(lambda self: any(self.pinned.values()))
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, c in self.pinned.items() if c)))
        self.pins.unpin([k])
        self.pinned[k] -= 1

    @rule()
    def reopen(self):
        self.t.close()
        self.t = self._open()

    @invariant()
    def matches_model_and_capacity(self):
        s = self.t.stats()
        assert s.used_bytes <= s.capacity_bytes == self.CAP * 4096
        held = {k for k, h in zip(self.keys, self.t.contains(self.keys)) if h}
        assert held == set(self.model)
        assert all(k in held for k, c in self.pinned.items() if c and k in self.model)


TestDiskModel = DiskModel.TestCase
TestDiskModel.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_damaged_index_costs_the_cache_not_the_store(tmp_path, make_keys, caplog):
    keys = make_keys(4)
    t = open_tier(tmp_path, 8, BB)
    t.put(keys, blocks_for(keys, BB))
    t.close()
    with open(tmp_path / "index" / "data.mdb", "r+b") as f:  # scribble over lmdb's meta pages
        f.write(b"\xa5" * 8192)
    with caplog.at_level(logging.ERROR):
        t = open_tier(tmp_path, 8, BB)
    assert "index cannot be read" in caplog.text and t.contains(keys) == [False] * 4
    assert t.put(keys, blocks_for(keys, BB)) == [True] * 4
    t.close()


def test_io_threads_run_in_order_and_refuse_work_once_the_tier_closed_them():
    """IoThreads falls back to the caller's thread only while the interpreter exits (test_store_shutdown.py has
    that case); after the tier's own close a run is refused, as the pool's."""
    io = IoThreads(2, "kvtier-test-io", "test tier")
    assert [f.result() for f in io.run_each(pow, [(2, 3), (3, 2), (5, 1)])] == [8, 9, 5]
    failed = io.run_each(int, [("x",)])[0]
    with pytest.raises(ValueError):
        failed.result()
    io.close()
    with pytest.raises(RuntimeError):
        io.run_each(pow, [(2, 3)])
