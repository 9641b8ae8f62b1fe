"""Write-behind shared by the pool and SSD tiers. WriteQueue: batches bounded in blocks, every job finished
exactly once (also when ``write`` raises, also when put after close), flush waits for all of it. WriteBehind:
staged blocks readable until written and independent of the caller's memory, the tier's ``held`` hook and
duplicates skipped, a waiting submit larger than staging stores every block, drops counted without ``wait``."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from kvtier.tiers.writebehind import WriteBehind, WriteQueue, staging_of

BB = 4096


@dataclass
class J:
    keys: list[bytes]


def test_batches_are_bounded_and_every_job_finishes_once():
    gate = threading.Event()
    batches: list[list[int]] = []
    finished: list[tuple[bytes, bool]] = []

    def write(jobs: list[J]) -> set[bytes]:
        gate.wait()
        batches.append([len(j.keys) for j in jobs])
        return {k for j in jobs for k in j.keys if k != b"bad"}

    def finish(jobs, stored):
        finished.extend((k, k in stored) for j in jobs for k in j.keys)

    q = WriteQueue(write, finish, max_batch=5, name="t", what="test")
    jobs = [J([b"%d-%d" % (i, n) for n in range(size)]) for i, size in enumerate([3, 2, 4, 1, 6, 2])]
    jobs.append(J([b"bad"]))
    for j in jobs:
        assert q.put(j)
    assert not q.flush(0.05)  # the writer is held at the gate
    gate.set()
    assert q.flush(10)
    # The first batch may hold only the first job (taken before the rest were queued); after it, batches fill
    # up to 5 blocks, and a job bigger than the bound goes alone.
    assert all(sum(b) <= 5 or len(b) == 1 for b in batches)
    assert sorted(n for b in batches for n in b) == sorted(len(j.keys) for j in jobs)
    assert sorted(finished) == sorted((k, k != b"bad") for j in jobs for k in j.keys)
    q.close()
    assert not q.put(J([b"late"]))  # closed: the caller finishes it


def test_a_write_that_raises_finishes_its_batch_as_not_stored_and_the_queue_goes_on(caplog):
    calls = []

    def write(jobs: list[J]) -> set[bytes]:
        calls.append(jobs)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return {k for j in jobs for k in j.keys}

    finished: list[tuple[bytes, bool]] = []
    q = WriteQueue(write, lambda jobs, stored: finished.extend((k, k in stored) for j in jobs for k in j.keys),
                   max_batch=10, name="t", what="test")
    assert q.put(J([b"a"])) and q.flush(10)
    assert q.put(J([b"b"])) and q.flush(10)
    q.close()
    assert finished == [(b"a", False), (b"b", True)]
    assert "test write-behind failed for 1 blocks" in caplog.text


def test_close_writes_what_is_queued():
    gate = threading.Event()
    done: list[bytes] = []

    def write(jobs: list[J]) -> set[bytes]:
        gate.wait()
        return {k for j in jobs for k in j.keys}

    q = WriteQueue(write, lambda jobs, stored: done.extend(sorted(stored)), max_batch=1, name="t", what="test")
    for k in (b"x", b"y", b"z"):
        q.put(J([k]))
    closer = threading.Thread(target=q.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and sorted(done) == [b"x", b"y", b"z"]


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        WriteQueue(lambda jobs: set(), lambda jobs, stored: None, max_batch=0, name="t", what="test")


class Below:
    """The tier below: real memory the writer copies staged blocks into, optionally held at a gate."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[list[bytes]] = []

    def write(self, keys: list[bytes], rows: np.ndarray) -> set[bytes]:
        self.gate.wait()
        self.batches.append(list(keys))
        for k, a in zip(keys, rows.tolist()):
            self.blocks[k] = bytes((np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * BB).from_address(a))))
        return {k for k in keys if k != b"refused"}


def _blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, BB), dtype=np.uint8)


def _ptrs(blocks: np.ndarray) -> np.ndarray:
    return np.array([blocks[i].ctypes.data for i in range(len(blocks))], np.uint64)


def _writer(below: Below, chunks: int, **hooks) -> tuple[WriteBehind, dict[str, int]]:
    wb = WriteBehind(below.write, staging_of(BB, chunks * BB), block_bytes=BB, max_batch=4, name="t",
                     what="test", **hooks)
    return wb, wb.counts  # the default bookkeeping (the pool tier's)


def test_staging_must_hold_a_block():
    with pytest.raises(ValueError, match="holds no block"):
        staging_of(BB, BB - 1)


def test_staged_blocks_are_readable_until_written_and_outlive_the_callers_memory():
    below = Below()
    below.gate.clear()
    wb, counts = _writer(below, 8)
    blocks = _blocks(3)
    expect = blocks.copy()
    keys = [b"a", b"b", b"refused"]
    future = wb.submit(keys, _ptrs(blocks), wait=False)
    blocks[:] = 0  # the caller reuses its memory at once
    assert wb.is_staged([*keys, b"x"]) == [True, True, True, False]
    out = np.zeros((4, BB), np.uint8)
    assert wb.read([b"b", b"x", b"a", b"refused"], _ptrs(out)) == [True, False, True, True]
    assert (out[0] == expect[1]).all() and (out[2] == expect[0]).all() and not out[1].any()
    below.gate.set()
    assert sorted(future.result(10)) == [b"a", b"b"]
    assert wb.flush(10) and wb.is_staged(keys) == [False] * 3
    assert below.blocks == {k: expect[i].tobytes() for i, k in enumerate(keys)}
    assert counts == {"queued": 3, "sent": 2, "dropped": 0, "failed": 1}
    wb.close()


def test_held_keys_and_duplicates_are_not_staged():
    below = Below()
    wb, counts = _writer(below, 8, held=lambda k: k == b"held")
    blocks = _blocks(4)
    assert sorted(wb.submit([b"a", b"held", b"a", b"b"], _ptrs(blocks), wait=True).result(10)) == [b"a", b"b"]
    assert sorted(k for b in below.batches for k in b) == [b"a", b"b"] and counts["queued"] == 2
    wb.close()


def test_a_waiting_submit_larger_than_staging_stores_every_block():
    """The pool tier's former PoolWriter dropped what did not fit in one allocation even when told to wait."""
    below = Below()
    wb, counts = _writer(below, 2)
    blocks = _blocks(7, seed=1)
    keys = [b"k%d" % i for i in range(7)]
    assert sorted(wb.submit(keys, _ptrs(blocks), wait=True).result(10)) == sorted(keys)
    assert below.blocks == {k: blocks[i].tobytes() for i, k in enumerate(keys)}
    assert counts["dropped"] == 0 and counts["sent"] == 7
    wb.close()


def test_without_wait_blocks_that_find_no_staging_are_dropped_and_counted():
    below = Below()
    below.gate.clear()
    wb, counts = _writer(below, 2)
    future = wb.submit([b"a", b"b", b"c", b"d", b"e"], _ptrs(_blocks(5)), wait=False)
    assert counts["dropped"] == 3 and counts["queued"] == 2
    below.gate.set()
    assert sorted(future.result(10)) == [b"a", b"b"]
    wb.close()


def test_a_submit_after_close_is_finished_as_not_stored():
    below = Below()
    wb, counts = _writer(below, 2)
    wb.close()
    assert wb.submit([b"a"], _ptrs(_blocks(1)), wait=True).result(10) == []
    assert counts == {"queued": 1, "sent": 0, "dropped": 0, "failed": 1} and wb.is_staged([b"a"]) == [False]
