"""The host-copy baseline (bench/copies.py): every candidate copies the bytes, the best is the fastest median."""

import numpy as np
import pytest

from kvtier.bench.copies import CANDIDATES, HostCopies


def _buffers(n=6, bb=256 << 10):
    src = (np.arange(n * bb, dtype=np.uint32) * 31 % 251).astype(np.uint8).reshape(n, bb)
    return src, np.zeros_like(src)


def test_every_candidate_is_timed_and_the_baseline_is_the_fastest():
    src, out = _buffers()
    with HostCopies(src, out) as copies:
        copies.round(keep=False)
        assert not any(copies.times.values())  # a warm-up round keeps nothing
        for _ in range(3):
            copies.round()
        fig = copies.figures()
        assert set(fig) == set(CANDIDATES) and all(g > 0 for g in fig.values())
        name, best = copies.best()
        assert best == max(fig.values()) and fig[name] == best
        rows = copies.rows({"block_bytes": 256 << 10})
    assert np.array_equal(out, src)
    assert {r["path"] for r in rows} == {f"copy: {c}" for c in CANDIDATES}
    assert all(r["baseline_gbps"] == round(best, 3) and r["ratio"] <= 1.0 for r in rows)


def test_a_copy_that_moves_nothing_is_an_error(monkeypatch):
    from kvtier.bench import copies as module

    src, out = _buffers()
    monkeypatch.setattr(module, "copy_rows", lambda *a: None)  # a broken copy routine
    with HostCopies(src, out) as copies, pytest.raises(RuntimeError, match="copy_rows 1 thread did not copy"):
        copies.round()


def test_mismatched_buffers_are_refused():
    src, _ = _buffers()
    with pytest.raises(ValueError, match="one \\(blocks, bytes\\) shape"):
        HostCopies(src, np.zeros((3, 10), np.uint8))
