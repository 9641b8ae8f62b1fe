"""WriteQueue, the write-behind queue shared by the pool and SSD tiers: batches bounded in blocks, every job
finished exactly once (also when ``write`` raises, also when put after close), flush waits for all of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from kvtier.writebehind import WriteQueue


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
