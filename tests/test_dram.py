import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.pins import PinTable
from kvtier.tiers.dram import DramTier

BB = 4096


def tier(blocks=8, **kw):
    t = DramTier(blocks * BB, BB, **kw)
    t.attach(PinTable(), None)
    return t


def test_put_get_bit_exact_all_input_forms(make_keys):
    t = tier(16)
    keys = make_keys(12)
    data = blocks_for(keys, BB)
    assert t.put(keys[:4], data[:4]) == [True] * 4                      # one 2-D tensor
    assert t.put(keys[4:8], [data[i] for i in range(4, 8)]) == [True] * 4  # list of tensors
    assert t.put(keys[8:10], data[8:10].numpy()) == [True] * 2          # numpy
    assert t.put(keys[10:], [bytes(data[10].numpy()), bytearray(data[11].numpy())]) == [True] * 2
    out = torch.zeros_like(data)
    assert_all_hits_exact(t.get(keys, out), out, data)
    outs = [np.zeros(BB, np.uint8) for _ in range(3)]
    assert t.get(keys[:3], outs) == [True] * 3
    assert all(np.array_equal(o, data[i].numpy()) for i, o in enumerate(outs))


def test_wrong_size_and_dtype_errors(make_keys):
    t = DramTier(8 * BB, BB, dtypes=("bfloat16",))
    t.attach(PinTable(), None)
    keys = make_keys(2)
    with pytest.raises(ValueError, match=f"expected {BB} bytes per block, got {BB // 2} bytes per row"):
        t.put(keys, torch.zeros(2, BB // 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=rf"blocks\[1\]: expected {BB} bytes, got 10 bytes"):
        t.put(keys, [torch.zeros(BB, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="expected dtype uint8 or bfloat16, got float32"):
        t.put(keys, torch.zeros(2, BB // 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="2 keys but 3 blocks"):
        t.put(keys, [torch.zeros(BB, dtype=torch.uint8)] * 3)
    assert t.stats().blocks == 0  # the failed calls stored nothing
    assert t.put(keys, torch.zeros(2, BB // 2, dtype=torch.bfloat16)) == [True, True]
    with pytest.raises(ValueError, match="read-only"):
        t.get(keys, [bytes(BB), bytes(BB)])
    assert t.stats().blocks == 2


def test_capacity_and_eviction_hand_back(make_keys):
    evicted = []
    t = DramTier(4 * BB, BB)
    t.attach(PinTable(), lambda keys, views: evicted.extend((k, bytes(v.numpy())) for k, v in zip(keys, views)))
    keys = make_keys(6)
    data = blocks_for(keys, BB)
    t.put(keys[:4], data[:4])
    t.put(keys[4:], data[4:])
    st = t.stats()
    assert st.used_bytes == 4 * BB == st.capacity_bytes and st.evictions == 2
    # LRU hands back the two oldest with their bytes, before the slots are reused.
    assert [k for k, _ in evicted] == keys[:2]
    assert [v for _, v in evicted] == [bytes(data[0].numpy()), bytes(data[1].numpy())]


def test_all_pinned_rejects_and_reports(make_keys):
    pins = PinTable()
    t = DramTier(2 * BB, BB)
    t.attach(pins, None)
    keys = make_keys(4)
    t.put(keys[:2], blocks_for(keys[:2], BB))
    pins.pin(keys[:2])
    assert t.put(keys[2:], blocks_for(keys[2:], BB)) == [False, False]
    assert list(t.contains(keys)) == [True, True, False, False]
    assert t.stats().rejected == 2
    pins.unpin(keys[:1])
    assert t.put(keys[2:], blocks_for(keys[2:], BB)) == [True, False]
    assert list(t.contains(keys)) == [False, True, True, False]


def test_duplicate_keys_in_one_batch(make_keys):
    t = tier(4)
    k = make_keys(1)[0]
    data = blocks_for([k, k], BB)
    assert t.put([k, k], data) == [True, True]
    assert t.stats().blocks == 1 and t.stats().used_bytes == BB


def test_a_read_of_a_repeated_key_holds_its_slot_once_per_occurrence(make_keys):
    """A get or acquire holds each slot once per occurrence in the batch (a repeated key: twice), and gives every
    count back: a removed block's slot is freed only when the last reader is done, and never twice."""
    t = tier(4)
    k, other = make_keys(2)
    t.put([k, other], blocks_for([k, other], BB))
    busy = t._table.busy
    with t.acquire([k, other, k]) as addresses:
        slot = (addresses[0] - int(t.buffer.ptr)) // BB
        assert busy[slot] == 2 and busy.sum() == 3
        with t.acquire([k]):
            assert busy[slot] == 3
        assert t.remove([k]) == 1  # still read: doomed, not freed
        assert t._table.alloc.free_count == 2
    assert not busy.any() and t._table.alloc.free_count == 3
    out = torch.zeros(3, BB, dtype=torch.uint8)
    assert t.get([other, other, other], out) == [True] * 3 and not busy.any()
    assert all(torch.equal(out[i], blocks_for([other], BB)[0]) for i in range(3))


def test_remove_while_reading_defers_the_free(make_keys):
    t = tier(2)
    keys = make_keys(3)
    data = blocks_for(keys, BB)
    t.put(keys[:2], data[:2])
    with t.read_views(keys[:1]) as views:
        assert t.remove(keys[:1]) == 1
        # The slot is still busy: a put must not reuse it while the view is alive.
        t.put(keys[2:], data[2:])
        assert torch.equal(views[0], data[0])
        assert list(t.contains(keys)) == [False, False, True]  # keys[1] was evicted instead
    assert t.stats().used_bytes == BB


def test_reserve_commit_and_abort(make_keys):
    t = tier(4)
    keys = make_keys(3)
    res = t.reserve(keys)
    assert list(t.contains(keys)) == [False] * 3  # not visible until committed
    assert t.reserve(keys).slots == []       # in flight: a second writer gets nothing to do
    for a in res.addresses.tolist():
        torch.from_numpy(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * BB).from_address(a))).fill_(7)
    t.commit(res)
    out = torch.zeros(3, BB, dtype=torch.uint8)
    assert_all_hits_exact(t.get(keys, out), out, 7)
    more = make_keys(1, start=10)
    aborted = t.reserve(more)
    t.commit(aborted, success=False)
    assert list(t.contains(more)) == [False] and t.stats().used_bytes == 3 * BB


def test_shared_memory_buffer_is_visible_to_another_process(tmp_path, make_keys):
    path = tmp_path / "pool.shm"
    t = DramTier(4 * BB, BB, shm_path=str(path))
    t.attach(PinTable(), None)
    keys = make_keys(1)
    data = blocks_for(keys, BB)
    t.put(keys, data)
    with t.acquire(keys) as (addr,):
        offset = addr - t.buffer.ptr
    code = (f"import torch; t=torch.from_file({str(path)!r}, shared=True, size={4 * BB}, dtype=torch.uint8);"
            f"import sys; sys.stdout.buffer.write(bytes(t[{offset}:{offset + BB}].numpy()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    assert out == bytes(data[0].numpy())


def test_too_small_capacity():
    with pytest.raises(ValueError, match="holds no block"):
        DramTier(100, BB)


def test_concurrent_readers_and_writers_on_one_tier(make_keys):
    t = tier(16)
    keys = make_keys(64)
    data = {k: b for k, b in zip(keys, blocks_for(keys, BB))}
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        out = torch.zeros(4, BB, dtype=torch.uint8)
        for _ in range(200):
            ks = [keys[i] for i in rng.choice(64, 4, replace=False)]
            if rng.random() < 0.5:
                t.put(ks, torch.stack([data[k] for k in ks]))
            else:
                hit = t.get(ks, out)
                errors.extend(k for k, h, o in zip(ks, hit, out) if h and not torch.equal(o, data[k]))
            if rng.random() < 0.05:
                t.remove(ks[:1])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    st = t.stats()
    assert st.used_bytes <= st.capacity_bytes and st.extra["pending"] == 0


def test_put_never_evicts_keys_of_its_own_batch(make_keys):
    t = tier(2)
    keys = make_keys(3)
    t.put(keys[:2], blocks_for(keys[:2], BB))
    # keys[0] is held and named again: the new key may evict keys[1] (not in the batch), never keys[0].
    assert t.put([keys[0], keys[2]], blocks_for([keys[0], keys[2]], BB)) == [True, True]
    assert list(t.contains(keys)) == [True, False, True]
    # Now every held key is in the batch: the new key is refused rather than evicting one of them.
    k3 = make_keys(1, start=3)[0]
    assert t.put([keys[0], keys[2], k3], blocks_for([keys[0], keys[2], k3], BB)) == [True, True, False]
    assert list(t.contains([keys[0], keys[2], k3])) == [True, True, False]


def test_store_from_default_config_picks_copy_threads_by_measured_rate(make_keys):
    """The DRAM tier a default Config builds times its copies (copy_threads 0): a batch of 1 MiB or more records its
    rate for the thread count it used, put and get apart, and the bytes are exact. A fixed count records nothing."""
    from kvtier.config import Config
    from kvtier.store import TieredStore

    bb, n = 64 << 10, 32  # a 2 MiB batch: timed (hostcopy.PARALLEL_MIN_BYTES)
    assert Config().copy_threads == 0
    keys = make_keys(n)
    data = blocks_for(keys, bb)
    with TieredStore.from_config({"dram_capacity": 2 * n * bb}, bb) as store:
        dram = store.tiers[0]
        assert store.put(keys, data).stored == n
        out = torch.zeros_like(data)
        assert_all_hits_exact(store.get(keys, out), out, data)
        for copies in (dram.put_copies, dram.get_copies):
            assert copies.configured == 0
            assert any(copies.rate(c, n * bb) > 0 for c in copies.choices)
    with TieredStore.from_config({"dram_capacity": 2 * n * bb, "copy_threads": 1}, bb) as store:
        store.put(keys, data)
        assert all(store.tiers[0].put_copies.rate(c, n * bb) == 0 for c in store.tiers[0].put_copies.choices)


def test_copy_threads_0_measures_each_tiers_puts_and_gets_apart(make_keys):
    """copy_threads 0: a tier's puts and its gets are timed by CopyThreads of their own, not by one process-wide
    measurement another tier's (or direction's) copies move."""
    bb, n = 64 << 10, 32  # 2 MiB batches: large enough to be timed (hostcopy.PARALLEL_MIN_BYTES)
    a, b = (DramTier(n * bb, bb, copy_threads=0) for _ in range(2))
    for t in (a, b):
        t.attach(PinTable(), None)
    keys = make_keys(n)
    data = blocks_for(keys, bb)

    def measured(copies):
        return sum(copies.rate(c, n * bb) > 0 for c in copies.choices)

    assert a.put(keys, data) == [True] * n
    assert measured(a.put_copies) >= 1 and measured(a.get_copies) == 0
    assert measured(b.put_copies) == 0 and measured(b.get_copies) == 0
    out = torch.zeros_like(data)
    assert_all_hits_exact(a.get(keys, out), out, data)
    assert measured(a.get_copies) >= 1 and measured(b.get_copies) == 0
    assert a.put_copies is not b.put_copies and a.put_copies is not a.get_copies
