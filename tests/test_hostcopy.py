import subprocess
import sys

import numpy as np
import pytest

from kvtier import hostcopy


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_rows_any_sizes_and_alignments(threads):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    # Row sizes from 1 byte to 1 MiB, at odd offsets, in shuffled order.
    sizes = [1, 15, 16, 17, 63, 4095, 16 * 1024, 16 * 1024 + 3, 100_000, 1 << 20]
    offs_src = [7 + sum(sizes[:i]) + i for i in range(len(sizes))]
    offs_dst = [3 + sum(sizes[:i]) + 2 * i for i in range(len(sizes))]
    order = rng.permutation(len(sizes))
    hostcopy.copy_rows(
        np.array([dst.ctypes.data + offs_dst[i] for i in order], np.uint64),
        np.array([src.ctypes.data + offs_src[i] for i in order], np.uint64),
        np.array([sizes[i] for i in order], np.uint64), threads)
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
    code = ("import numpy as np; from kvtier import hostcopy; assert not hostcopy.NATIVE;"
            "a=np.arange(100000,dtype=np.uint8); b=np.zeros_like(a);"
            "hostcopy.copy_rows(np.array([b.ctypes.data],np.uint64), np.array([a.ctypes.data],np.uint64), 100000);"
            "assert (a==b).all(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"KVTIER_NATIVE_CPU": "0", "PATH": ""})
    assert r.stdout.strip() == "ok", r.stderr


def test_mismatched_tables():
    with pytest.raises(ValueError, match="2 destinations but 1 sources"):
        hostcopy.copy_rows(np.zeros(2, np.uint64), np.zeros(1, np.uint64), 8)


# ---- copy_threads: how many threads a batch gets ---------------------------------------------------------

def test_copy_threads_by_batch_size_spare_core_and_configured(monkeypatch):
    from kvtier import hostcopy

    monkeypatch.setattr(hostcopy, "_CORES", 2)
    monkeypatch.setattr(hostcopy, "spare_core", lambda: True)
    assert hostcopy.copy_threads(hostcopy.PARALLEL_MIN_BYTES - 1) == 1
    assert hostcopy.copy_threads(hostcopy.PARALLEL_MIN_BYTES) == 2
    assert hostcopy.copy_threads(1 << 30) == 2
    assert hostcopy.copy_threads(1 << 30, 1) == 1  # configured wins, either way
    assert hostcopy.copy_threads(4096, 3) == 3
    monkeypatch.setattr(hostcopy, "spare_core", lambda: False)  # every core busy: the second thread would wait
    assert hostcopy.copy_threads(1 << 30) == 1
    assert hostcopy.copy_threads(1 << 30, 2) == 2


def test_copy_threads_never_more_than_usable_cores(monkeypatch):
    from kvtier import hostcopy

    monkeypatch.setattr(hostcopy, "_CORES", 1)
    monkeypatch.setattr(hostcopy, "spare_core", lambda: True)
    assert hostcopy.copy_threads(1 << 30) == 1
    monkeypatch.setattr(hostcopy, "_CORES", 16)
    assert hostcopy.copy_threads(1 << 30) == hostcopy.AUTO_MAX_THREADS


def test_spare_core_reads_the_load_average_at_most_once_a_check_interval(monkeypatch):
    from kvtier import hostcopy

    loads = iter([(0.2, 0, 0), (5.0, 0, 0)])
    monkeypatch.setattr(hostcopy.os, "getloadavg", lambda: next(loads))
    monkeypatch.setattr(hostcopy, "_CORES", 2)
    monkeypatch.setattr(hostcopy, "_spare", (-1e9, False))
    clock = [1000.0]
    monkeypatch.setattr(hostcopy.time, "monotonic", lambda: clock[0])
    assert hostcopy.spare_core()  # load 0.2 < 2 - 1
    clock[0] += hostcopy.LOAD_CHECK_S / 2
    assert hostcopy.spare_core()  # not re-read yet
    clock[0] += hostcopy.LOAD_CHECK_S
    assert not hostcopy.spare_core()  # load 5 on 2 cores
