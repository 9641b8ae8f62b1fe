"""``kvtier bench tiers --tier pool`` end to end at a small size: real pool and raw-socket peer processes, every
path's rows beside their baselines, bytes checked inside the bench, and the Mooncake note when it is absent."""

import json
import subprocess
import sys

import pytest

from kvtier.bench.copies import CANDIDATES


@pytest.mark.slow
def test_bench_pool_writes_every_path_beside_its_baseline(tmp_path):
    out = tmp_path / "pool.json"
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "tiers", "--tier", "pool", "--sizes", "64KiB,1MiB",
                        "--total", "16MiB", "--rounds", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    lookups = [row for row in rows if row["tier"] == "lookup"]  # 2,000 present keys, beside a zmq echo each
    assert {(row["path"], row["op"]) for row in lookups} == {("pool-shm", "contains"), ("pool-tcp", "contains"),
                                                             ("master", "lookup")}
    assert all(row["p50_us"] > 0 and row["baseline_us"] > 0 for row in lookups)
    rows = [row for row in rows if row["tier"] != "lookup"]
    paths = {(row["path"], row["op"], row["block_bytes"]) for row in rows}
    for bb in (64 << 10, 1 << 20):
        for path in ("raw-socket", "stream", "tcp", "shm"):
            assert {(path, "put", bb), (path, "get", bb)} <= paths
        # the shm rows' baseline is the fastest copy of the same bytes, each candidate printed beside it
        copies = [row for row in rows if row["block_bytes"] == bb and row["op"] == "copy"]
        assert {row["path"] for row in copies} == {f"copy: {c}" for c in CANDIDATES}
        best = max(row["gbps"] for row in copies)
        assert {row["baseline_gbps"] for row in rows if row["block_bytes"] == bb and
                row["path"] in ("shm", "shm-1thread", *(c["path"] for c in copies))} == {best}
    for row in rows:
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
        # figures and ratio are rounded to 0.001: a figure of a few hundredths (a crowded machine) is off by 1% or more
        rounding = 0.0005 / row["gbps"] + 0.0005 / row["baseline_gbps"]
        assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"], rel=0.01 + rounding, abs=0.0005)
        if row["path"] == "raw-socket":
            assert row["ratio"] == 1.0
    if not any(row["path"] == "mooncake" for row in rows):
        assert "Mooncake Store: not measured" in r.stdout
