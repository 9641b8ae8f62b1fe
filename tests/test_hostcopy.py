import subprocess
import sys

import numpy as np
import pytest

from kvtier.memory import hostcopy


@pytest.mark.parametrize("threads", [0, 1, 2, 3])
def test_copy_rows_any_sizes_and_alignments(threads):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    # Row sizes from 1 byte to 1 MiB, at odd offsets, in shuffled order.
    sizes = [1, 15, 16, 17, 63, 4095, 16 * 1024, 16 * 1024 + 3, 16 * 1024 + 127, 16 * 1024 + 161, 100_000, 1 << 20]
    offs_src = [7 + sum(sizes[:i]) + i for i in range(len(sizes))]
    offs_dst = [3 + sum(sizes[:i]) + 2 * i for i in range(len(sizes))]
    order = rng.permutation(len(sizes))
    copy = hostcopy.CopyThreads().copy if threads == 0 else lambda d, s, n: hostcopy.copy_rows(d, s, n, threads)
    copy(np.array([dst.ctypes.data + offs_dst[i] for i in order], np.uint64),
         np.array([src.ctypes.data + offs_src[i] for i in order], np.uint64),
         np.array([sizes[i] for i in order], np.uint64))
    for s, a, b in zip(sizes, offs_src, offs_dst):
        assert np.array_equal(dst[b:b + s], src[a:a + s])
    # Bytes outside the rows were not touched.
    touched = np.zeros(len(dst), bool)
    for s, b in zip(sizes, offs_dst):
        touched[b:b + s] = True
    assert not dst[~touched].any()


def test_native_library_is_built():
    assert hostcopy.NATIVE, "kvtier._native_cpu was not built at install"


def test_fallback_without_native_library():
    code = ("import numpy as np; from kvtier.memory import hostcopy; assert not hostcopy.NATIVE;"
            "a=np.arange(100000,dtype=np.uint8); b=np.zeros_like(a);"
            "hostcopy.copy_rows(np.array([b.ctypes.data],np.uint64), np.array([a.ctypes.data],np.uint64), 100000);"
            "assert (a==b).all(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"KVTIER_NATIVE_CPU": "0", "PATH": ""})
    assert r.stdout.strip() == "ok", r.stderr


def test_mismatched_tables():
    with pytest.raises(ValueError, match="2 destinations but 1 sources"):
        hostcopy.copy_rows(np.zeros(2, np.uint64), np.zeros(1, np.uint64), 8)


# ---- CopyThreads: how many threads a batch gets -------------------------------------------------------

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _chooser(clock=None, **kw):
    return hostcopy.CopyThreads(choices=(1, 2), clock=clock or Clock(), **kw)


def _measured(c, threads, gbs, times=hostcopy.PROBE_BATCHES, nbytes=64 * MIB):
    for _ in range(times):
        c.record(threads, nbytes, nbytes / gbs)


def test_threads_follow_the_measured_rates_not_the_load():
    c = _chooser()
    probes = []
    for _ in range(hostcopy.PROBE_BATCHES):  # nothing measured: the choices in turn, each batch timed
        for threads, gbs in ((1, 7e9), (2, 11.5e9)):
            probes.append(c.pick(64 * MIB))
            _measured(c, probes[-1], gbs if probes[-1] == threads else 1.0, times=1)
    assert probes == [1, 2] * hostcopy.PROBE_BATCHES
    assert [c.pick(64 * MIB) for _ in range(5)] == [2] * 5  # two threads measured faster here
    c = _chooser()
    _measured(c, 1, 9e9)
    _measured(c, 2, 4e9)  # a second thread waiting for a core
    assert [c.pick(64 * MIB) for _ in range(5)] == [1] * 5


def test_a_cold_first_batch_does_not_decide():
    c = _chooser()
    c.record(1, 64 * MIB, 64 * MIB / 0.5e9)  # the first copy faulted the pool's file in
    _measured(c, 2, 8e9)
    assert c.pick(64 * MIB) == 1  # one thread has one sample: measured again before anything is decided
    _measured(c, 1, 12e9, times=hostcopy.PROBE_BATCHES - 1)
    assert [c.pick(64 * MIB) for _ in range(3)] == [1] * 3  # median of 0.5, 12, 12: one thread is faster


def test_small_batches_take_one_thread_and_configured_counts_win():
    c = _chooser()
    c.record(2, 64 * MIB, 0.001)
    assert c.pick(hostcopy.PARALLEL_MIN_BYTES - 1) == 1
    fixed = hostcopy.CopyThreads(3, choices=(1, 2), clock=Clock())
    fixed.record(1, 64 * MIB, 0.0001)  # a fixed count measures nothing
    assert fixed.pick(4096) == fixed.pick(1 << 30) == 3
    assert fixed.rate(1, 64 * MIB) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        hostcopy.CopyThreads(-1)


def test_the_losing_choice_is_measured_again_after_the_reprobe_interval():
    clock = Clock()
    c = _chooser(clock)
    _measured(c, 1, 10e9)
    _measured(c, 2, 11e9)  # a narrow margin: re-probed every REPROBE_BATCHES
    assert c.pick(64 * MIB) == 2
    clock.now += hostcopy.REPROBE_S
    # Not measured for a while, but only one batch went to the best since: a caller of few big batches is not
    # re-probed at every one of them.
    assert [c.pick(64 * MIB) for _ in range(hostcopy.REPROBE_BATCHES - 1)] == [2] * (hostcopy.REPROBE_BATCHES - 1)
    assert c.pick(64 * MIB) == 1  # one thread not measured for a while: one batch measures it again
    assert c.pick(64 * MIB) == 2  # ... and meanwhile the other batches take the best
    clock.now += hostcopy.REPROBE_S
    assert c.pick(64 * MIB) == 2  # the time has passed again, the batches not yet
    for _ in range(hostcopy.RATE_WINDOW):  # the host got busier: one thread is now the faster
        c.record(1, 64 * MIB, 64 * MIB / 12e9)
    for _ in range(hostcopy.RATE_WINDOW):
        c.record(2, 64 * MIB, 64 * MIB / 5e9)
    assert c.pick(64 * MIB) == 1


def test_a_rate_is_the_median_of_recent_batches_and_per_size_class():
    c = _chooser()
    for gbs in (8e9, 8e9, 0.5e9):  # one batch preempted mid-copy moves the median nothing
        c.record(1, 64 * MIB, 64 * MIB / gbs)
    assert c.rate(1, 64 * MIB) == pytest.approx(8e9)
    assert c.rate(1, 2 * MIB) == 0.0  # a small batch's rate is its own: thread start weighs on it
    _measured(c, 2, 12e9)
    assert c.pick(2 * MIB) == 1 and c.pick(96 * MIB) == 2
    assert [hostcopy.size_class(b) for b in (MIB, 4 * MIB - 1, 4 * MIB, 16 * MIB, 64 * MIB, 1 << 34)] == \
        [0, 0, 1, 2, 3, 3]


def test_concurrent_batches_do_not_all_probe():
    clock = Clock()
    c = _chooser(clock)
    assert c.pick(64 * MIB) == 1  # claimed by a batch still copying
    assert c.pick(64 * MIB) == 2  # the next batch probes the other choice
    assert c.pick(64 * MIB) == 1  # nothing measured yet, both claimed: the one claimed longest ago
    _measured(c, 1, 9e9)
    _measured(c, 2, 8e9)
    assert [c.pick(64 * MIB) for _ in range(hostcopy.REPROBE_BATCHES)] == [1] * hostcopy.REPROBE_BATCHES
    clock.now += hostcopy.REPROBE_S
    assert [c.pick(64 * MIB) for _ in range(3)] == [2, 1, 1]  # one batch re-probes two threads, not all three


def test_a_clear_winner_is_re_probed_less_often():
    """Two threads 1.5x one (21 vs 14 GB/s, a put into the pool's file): the slower count is measured again
    after CLEAR_WIN_SPACING x REPROBE_BATCHES batches, not every REPROBE_BATCHES; at a narrow margin (1.1x) after
    REPROBE_BATCHES. Counted over the same 200 batches, REPROBE_S passed before each."""
    def reprobes(one: float, two: float) -> int:
        clock = Clock()
        c = _chooser(clock)
        _measured(c, 1, one)
        _measured(c, 2, two)
        picks = []
        for _ in range(200):
            clock.now += hostcopy.REPROBE_S
            picks.append(c.pick(64 * MIB))
        return picks.count(1)

    spacing = hostcopy.REPROBE_BATCHES * hostcopy.CLEAR_WIN_SPACING
    assert reprobes(14e9, 21e9) == 200 // (spacing + 1)
    assert reprobes(19e9, 21e9) == 200 // (hostcopy.REPROBE_BATCHES + 1)
    # the best's own rate falling below the other's last one: the other is picked at once, margin or not
    clock = Clock()
    c = _chooser(clock)
    _measured(c, 1, 14e9)
    _measured(c, 2, 21e9)
    assert c.pick(64 * MIB) == 2
    _measured(c, 2, 7e9, times=hostcopy.RATE_WINDOW)
    assert c.pick(64 * MIB) == 1


def test_copy_times_and_records_the_threads_it_used():
    c = _chooser()
    src = np.arange(8 * MIB, dtype=np.uint32).astype(np.uint8)
    dst = np.zeros_like(src)
    rows = np.arange(8, dtype=np.uint64) * np.uint64(MIB)
    used = [c.copy(np.uint64(dst.ctypes.data) + rows, np.uint64(src.ctypes.data) + rows, MIB) for _ in range(7)]
    assert np.array_equal(dst, src)
    assert set(used) <= {1, 2}
    assert c.rate(1, 8 * MIB) > 0 and c.rate(2, 8 * MIB) > 0


def test_auto_choices_never_exceed_the_usable_cores(monkeypatch):
    monkeypatch.setattr(hostcopy, "_CORES", 1)
    assert hostcopy.CopyThreads().choices == (1,)
    assert hostcopy.CopyThreads().pick(1 << 30) == 1
    monkeypatch.setattr(hostcopy, "_CORES", 16)
    assert hostcopy.CopyThreads().choices == tuple(range(1, hostcopy.AUTO_MAX_THREADS + 1))


def test_a_probe_splits_a_big_batch_between_two_counts_and_copies_every_byte():
    """A probing batch whose halves are each a batch of its size class copies one half on each count: one batch
    measures both, the choice is made after PROBE_BATCHES batches (not that many per count), every row's bytes
    arrive (ragged rows: the halves split by rows, measured by bytes), and a batch too small to split measures
    one count."""
    rng = np.random.default_rng(1)
    rows, bb = 48, 64 << 10  # about 2.6 MiB: two halves of 1 MiB or more, the same size class as the whole
    src = rng.integers(0, 256, rows * bb, dtype=np.uint8)
    c = _chooser()
    for i in range(hostcopy.PROBE_BATCHES):
        dst = np.zeros_like(src)
        sizes = rng.integers(bb * 3 // 4, bb, rows, endpoint=True).astype(np.uint64)
        offs = np.arange(rows, dtype=np.uint64) * np.uint64(bb)
        total = int(sizes.sum())
        c.copy(np.uint64(dst.ctypes.data) + offs, np.uint64(src.ctypes.data) + offs, sizes)
        for r, k in enumerate(sizes.tolist()):
            a = r * bb
            assert np.array_equal(dst[a:a + k], src[a:a + k]) and not dst[a + k:a + bb].any(), f"row {r}"
        assert c.rate(1, total) > 0 and c.rate(2, total) > 0, f"batch {i} measured one count only"
    best = max(c.choices, key=lambda t: c.rate(t, total))
    assert [c.pick(total) for _ in range(4)] == [best] * 4  # probing is over; the clock stands still: no re-probe

    small = _chooser()
    one_mib = np.zeros(24 * bb, np.uint8)  # 1.5 MiB: halves under PARALLEL_MIN_BYTES are not timed apart
    offs = np.arange(24, dtype=np.uint64) * np.uint64(bb)
    small.copy(np.uint64(one_mib.ctypes.data) + offs, np.uint64(src.ctypes.data) + offs, bb)
    assert np.array_equal(one_mib, src[:24 * bb])
    assert sorted(small.rate(t, 24 * bb) > 0 for t in small.choices) == [False, True]
