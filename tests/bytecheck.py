"""Byte checks after a get or load: the rows it reported as hits must be exactly the expected bytes; the rows it
reported as misses are counted apart and never compared (a miss may be allowed, under load or past a quota; a
wrong byte never is). Comparing the whole output buffer instead calls every miss "wrong bytes" (issue 23).

    got = check_rows(hit, out, want)             # Rows: hits, misses, wrong
    assert_no_wrong_bytes(hit, out, want)        # misses allowed; returns the Rows for further asserts
    assert_all_hits_exact(hit, out, want)        # no wrong byte, then no miss: two failures, two messages

``hit`` is a get's per-row answer (bools); ``out`` the rows it wrote into and ``want`` the expected rows (numpy
arrays, CPU torch tensors or lists of one bytes object per row; any row shape) or one byte value every hit row
must be filled with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Rows:
    """What a byte check found: rows served right, rows reported missing, hit rows with other bytes."""

    hits: int
    misses: list[int] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.hits} hits ({len(self.wrong)} with wrong bytes: rows {self.wrong[:8]}), "
                f"{len(self.misses)} misses (rows {self.misses[:8]})")


def _rows(a: Any, n: int) -> np.ndarray:
    """``a``'s bytes as ``n`` rows of uint8 (a tensor of any dtype, bfloat16 too, is compared as its bytes)."""
    if isinstance(a, (list, tuple)) and a and isinstance(a[0], (bytes, bytearray)):  # one bytes object per row
        a = np.frombuffer(b"".join(a), np.uint8)
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    arr = np.ascontiguousarray(np.asarray(a))
    return arr.view(np.uint8).reshape(n, -1) if n else arr.view(np.uint8).reshape(0, 0)


def check_rows(hit: Sequence[bool], out: Any, want: Any) -> Rows:
    """Compare the hit rows of ``out`` with ``want`` (rows, or one byte value for every row); count the misses."""
    flags = [bool(h) for h in hit]
    n = len(flags)
    got = _rows(out, n)
    if len(got) != n:
        raise ValueError(f"{n} answers for {len(got)} rows")
    if isinstance(want, (int, np.integer)):
        wrong = [i for i, h in enumerate(flags) if h and not (got[i] == want).all()]
    else:
        expect = _rows(want, n)
        if expect.shape != got.shape:
            raise ValueError(f"expected rows of shape {expect.shape}, got {got.shape}")
        wrong = [i for i, h in enumerate(flags) if h and not np.array_equal(got[i], expect[i])]
    misses = [i for i, h in enumerate(flags) if not h]
    return Rows(hits=n - len(misses), misses=misses, wrong=wrong)


def assert_no_wrong_bytes(hit: Sequence[bool], out: Any, want: Any) -> Rows:
    """Every hit row is its expected bytes; misses are allowed and returned (``.misses``) for the caller."""
    got = check_rows(hit, out, want)
    assert not got.wrong, f"wrong bytes served: {got}"
    return got


def assert_all_hits_exact(hit: Sequence[bool], out: Any, want: Any) -> Rows:
    """No hit row has wrong bytes, and (checked second, with its own message) no row was a miss."""
    got = assert_no_wrong_bytes(hit, out, want)
    assert not got.misses, f"misses where every row should hit (the bytes that were served are right): {got}"
    return got
