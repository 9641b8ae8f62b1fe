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
