"""Reads where a one-sided client last saw its blocks (kvtier/transport/locations.py): a get of what the
connection put or read before sends the pool no request, and is still never another key's bytes nor a block
the pool no longer holds. Real pool processes, shared memory, real generation files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bytecheck import assert_all_hits_exact
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from kvtier.transport.locations import Locations
from kvtier.wire import pool as P
from poolproc import PoolProcess, until

BB = 64 << 10
ns = Namespace("locations")


def rows(a: np.ndarray) -> np.ndarray:
    return np.uint64(a.ctypes.data) + np.arange(len(a), dtype=np.uint64) * np.uint64(a.shape[1])


def filled(n: int, value: int) -> np.ndarray:
    return np.full((n, BB), value, dtype=np.uint8)


def requests_of(conn) -> list[str]:
    """Record the ops ``conn`` sends from now on (batched, called and notified)."""
    sent: list[str] = []
    ch = conn.channel
    batch, call, notify = ch.batch, ch.call, ch.notify

    def spy_batch(requests, *a, **kw):
        return batch((sent.append(r.op) or r for r in requests), *a, **kw)

    def spy_call(op, *a, **kw):
        sent.append(op)
        return call(op, *a, **kw)

    def spy_notify(op, *a, **kw):
        sent.append(op)
        return notify(op, *a, **kw)
    ch.batch, ch.call, ch.notify = spy_batch, spy_call, spy_notify
    return sent


def test_a_get_of_what_the_connection_put_asks_nothing_and_the_pool_counts_it(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB) as p:
        c = connect(p.ipc, BB, timeout_s=5.0)
        keys = ns.keys(range(16))
        src, out = filled(16, 0x5A), filled(16, 0)
        assert c.put(keys, rows(src)) == [True] * 16
        sent = requests_of(c)
        assert_all_hits_exact(c.get(keys, rows(out)), out, 0x5A)
        assert sent == [P.TOUCH]  # no acquire: the report after the copy only
        assert until(lambda: c.stats()["counters"].get("located_reads", 0) == 16)
        counters = c.stats()["counters"]
        assert counters["get_hits"] == 16 and counters.get("get_misses", 0) == 0
        assert c.stats()["leases"] == 0
        # a mixed batch: the known ones read in place, the rest acquired (misses here)
        more = keys[:4] + ns.keys(range(100, 104))
        out = filled(8, 0)
        sent.clear()
        hit = c.get(more, rows(out))
        assert hit == [True] * 4 + [False] * 4
        assert (out[:4] == 0x5A).all() and not out[4:].any()
        assert sorted(sent) == sorted([P.TOUCH, P.ACQUIRE])
        c.close()


def test_gets_of_located_blocks_from_many_threads_at_once_all_read_their_bytes(tmp_path):
    """Each such get asks whether the pool's process still lives (a pidfd polled); a select.poll object refuses
    a second poll() while one runs: 4 threads' gets on one connection failed with "concurrent poll() invocation"."""
    import threading

    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB) as p:
        c = connect(p.ipc, BB, timeout_s=5.0)
        keys = ns.keys(range(8))
        src = filled(8, 0x3C)
        assert c.put(keys, rows(src)) == [True] * 8
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                for _ in range(300):
                    out = filled(8, 0)
                    assert_all_hits_exact(c.get(keys, rows(out)), out, 0x3C)
            except BaseException as e:  # reported below
                errors.append(e)
        threads = [threading.Thread(target=reader) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        c.close()


def test_what_an_acquire_found_is_read_in_place_the_next_time(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB) as p:
        writer, reader = connect(p.ipc, BB, timeout_s=5.0), connect(p.ipc, BB, timeout_s=5.0)
        keys = ns.keys(range(200, 208))
        src = filled(8, 0x33)
        assert writer.put(keys, rows(src)) == [True] * 8
        sent = requests_of(reader)
        out = filled(8, 0)
        assert_all_hits_exact(reader.get(keys, rows(out)), out, 0x33)
        assert P.ACQUIRE in sent and P.TOUCH not in sent
        sent.clear()
        out = filled(8, 0)
        assert_all_hits_exact(reader.get(keys, rows(out)), out, 0x33)
        assert sent == [P.TOUCH]
        writer.close()
        reader.close()


def test_a_key_another_client_removed_is_a_miss_though_its_bytes_are_still_in_the_slot(tmp_path):
    """The pool bumps a slot's generation when its key leaves it, so a read where the block was is a miss even
    when no new key took the slot (its bytes are still there: only the generation tells)."""
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB) as p:
        a, b = connect(p.ipc, BB, timeout_s=5.0), connect(p.ipc, BB, timeout_s=5.0)
        keys = ns.keys(range(300, 304))
        src = filled(4, 0xAA)
        assert a.put(keys, rows(src)) == [True] * 4
        assert b.remove(keys[:2]) == 2
        out = filled(4, 0x11)
        assert a.get(keys, rows(out)) == [False, False, True, True]
        assert not out[:2].any() and (out[2:] == 0xAA).all()  # the misses' rows zeroed, not left stale
        assert len(a.locations) == 2  # the removed ones forgotten
        a.close()
        b.close()


def test_a_slot_another_key_took_is_never_read_as_the_old_key(tmp_path):
    """One slot: b removes a's key and stores another there (other bytes). a's read where it saw its key finds
    the generation changed: a miss, its row zeroed, never b's bytes. Once the key is stored again, a finds it by
    acquire, and reads it in place after that."""
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity=str(BB), block_bytes=BB) as p:
        a, b = connect(p.ipc, BB, timeout_s=5.0), connect(p.ipc, BB, timeout_s=5.0)
        x, y = ns.keys([400, 401])
        mine, theirs = filled(1, 0xAA), filled(1, 0xBB)
        assert a.put([x], rows(mine)) == [True]
        b.remove([x])
        assert b.put([y], rows(theirs)) == [True]  # the pool's one slot, now y's
        out = filled(1, 0x11)
        assert a.get([x], rows(out)) == [False] and not out.any()
        assert b.put([x], rows(mine)) == [True]  # x back (y evicted), in the same slot, a newer generation
        sent = requests_of(a)
        out = filled(1, 0)
        assert_all_hits_exact(a.get([x], rows(out)), out, 0xAA)
        assert P.ACQUIRE in sent and P.TOUCH not in sent
        sent.clear()
        out = filled(1, 0)
        assert_all_hits_exact(a.get([x], rows(out)), out, 0xAA)
        assert sent == [P.TOUCH]
        a.close()
        b.close()


def test_blocks_evicted_by_another_clients_puts_are_misses(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity=str(8 * BB), block_bytes=BB) as p:
        a, b = connect(p.ipc, BB, timeout_s=5.0), connect(p.ipc, BB, timeout_s=5.0)
        mine, theirs = ns.keys(range(500, 508)), ns.keys(range(600, 608))
        src_a, src_b = filled(8, 0xA1), filled(8, 0xB2)
        assert a.put(mine, rows(src_a)) == [True] * 8
        assert b.put(theirs, rows(src_b)) == [True] * 8  # every one of a's evicted, the slots refilled
        out = filled(8, 0x11)
        assert a.get(mine, rows(out)) == [False] * 8 and not out.any()
        assert len(a.locations) == 0
        a.close()
        b.close()


def test_after_a_pool_restart_nothing_is_read_from_the_old_pools_memory(tmp_path):
    """The old pool's file stays mapped here (unlinked) while the new pool starts empty: a read where the blocks
    were would find the old bytes and unchanged generations, so the file itself is checked first."""
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB) as p:
        c = connect(p.ipc, BB, timeout_s=5.0)
        keys = ns.keys(range(700, 704))
        src = filled(4, 0x77)
        assert c.put(keys, rows(src)) == [True] * 4
        p.kill()
        p.start()
        out = filled(4, 0x11)
        hit = until(lambda: _get_or_none(c, keys, out), timeout=10.0)  # the first call may meet the restart
        assert hit == [False] * 4 and (out == 0).all() | (out == 0x11).all()
        assert len(c.locations) == 0
        c.close()


def test_a_killed_pools_memory_is_not_read_though_its_file_is_still_there(tmp_path):
    """kill -9 leaves the pool's file (and its generations) in place, bytes intact: a read where the blocks were
    would be a hit from a pool that is gone. The client watches the pool's process (a pidfd): the get asks the
    pool instead, and fails by its deadline, nothing copied."""
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity="4MiB", block_bytes=BB) as p:
        c = connect(p.ipc, BB, timeout_s=1.0)
        keys = ns.keys(range(800, 804))
        src = filled(4, 0x66)
        assert c.put(keys, rows(src)) == [True] * 4
        shm_file = Path(p.info["shm_path"])
        p.kill()
        assert shm_file.exists()  # the premise: the dead pool's bytes are still mapped and on /dev/shm
        out = filled(4, 0x11)
        with pytest.raises(PoolError):
            c.get(keys, rows(out))
        assert (out == 0x11).all()
        c.close()


def _get_or_none(c, keys, out):
    try:
        return c.get(keys, rows(out))
    except PoolError:
        return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["learn", "forget", "find"]), st.lists(st.integers(0, 11), max_size=6),
                          st.integers(0, 7)), max_size=40))
def test_locations_hold_at_most_one_key_per_slot_and_their_bound(ops):
    """Against a plain model: each key maps to the slot and generation it was learned at last; a slot learned
    for a new key forgets the old one; never more than the bound."""
    loc = Locations(max_entries=5)
    model: dict[bytes, tuple[int, int]] = {}
    for op, ids, slot in ops:
        keys = [bytes([i]) * 16 for i in ids]
        if op == "learn":
            offs = np.array([(slot + j) * BB for j in range(len(keys))], dtype=np.int64)
            gens = np.arange(1, len(keys) + 1, dtype=np.uint64)
            loc.learn(7, keys, offs, gens)
            for k, o, g in zip(keys, offs.tolist(), gens.tolist()):
                model = {kk: v for kk, v in model.items() if v[0] != o and kk != k}
                model[k] = (o, g)
            while len(model) > 5:
                model.pop(next(iter(model)))
        elif op == "forget":
            loc.forget(keys)
            for k in keys:
                model.pop(k, None)
        index, offs, gens = loc.find(7, keys)
        want = [(i, *model[k]) for i, k in enumerate(keys) if k in model]
        assert list(zip(index.tolist(), offs.tolist(), gens.tolist())) == want
        assert len(loc) == len(model) <= 5
        assert not len(loc.find(8, keys)[0])  # another epoch: nothing
