"""``kvtier bench engine`` runs end to end on the real CPU engine (one short round; the figures themselves are
the benchmark's, not asserted here): every row has its three timings, the kvtier-warm request really hit
kvtier and the HBM-hit request really hit vLLM's own prefix cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_engine_rows(engine_py, tmp_path):
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "engine", "--prefix", "320,640", "--rounds",
                        "1", "--python", str(engine_py), "--json", str(out)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["prefix_tokens"] for row in rows] == [320, 640]
    for row in rows:
        assert row["kvtier_hit_tokens"] == row["hbm_hit_tokens"] == row["prefix_tokens"]  # whole blocks of 32
        assert row["cold_ms"] > 0 and row["kvtier_ms"] > 0 and row["hbm_ms"] > 0
        assert row["kvtier_over_cold"] == pytest.approx(row["kvtier_ms"] / row["cold_ms"], rel=0.01)
    assert "kvtier/cold" in r.stdout
