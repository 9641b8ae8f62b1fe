"""The shared byte check (tests/bytecheck.py) tells a wrong byte from a miss: a hit row with one byte off fails,
a miss row is counted and never compared, and tensors are compared as their bytes (bfloat16 too)."""

import numpy as np
import pytest
import torch

from bytecheck import assert_all_hits_exact, assert_no_wrong_bytes, check_rows


def test_a_wrong_byte_in_a_hit_row_fails_and_a_miss_row_is_counted_not_compared():
    want = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)
    out = want.copy()
    out[2] = 0  # a miss: the row untouched
    got = check_rows([True, True, False, True], out, want)
    assert (got.hits, got.misses, got.wrong) == (3, [2], [])
    assert assert_no_wrong_bytes([True, True, False, True], out, want).misses == [2]
    with pytest.raises(AssertionError, match="misses where every row should hit"):
        assert_all_hits_exact([True, True, False, True], out, want)
    out[3, 5] ^= 1
    with pytest.raises(AssertionError, match=r"wrong bytes served: .*rows \[3\]"):
        assert_no_wrong_bytes([True, True, False, True], out, want)


def test_one_fill_value_and_tensors_of_any_dtype_compare_as_bytes():
    assert check_rows([True, False], np.array([[7, 7], [0, 0]], np.uint8), 7).wrong == []
    assert check_rows([True], np.array([[7, 6]], np.uint8), 7).wrong == [0]
    t = torch.zeros(3, 8, dtype=torch.bfloat16)
    w = t.clone()
    w[1, 1] = 1.0
    assert check_rows([True, True, True], t, w).wrong == [1]
    assert check_rows([True, False, True], t, w).wrong == []
    assert check_rows([], torch.zeros(0, 8), torch.zeros(0, 8)).hits == 0


def test_rows_given_as_one_bytes_object_each_are_compared_row_by_row():
    want = [b"\1\2\3", b"\4\5\6"]
    assert check_rows([True, True], [b"\1\2\3", b"\4\5\7"], want).wrong == [1]
    assert check_rows([True, False], [b"\1\2\3", b"\0\0\0"], want).misses == [1]
