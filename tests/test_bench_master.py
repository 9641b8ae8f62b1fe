"""``kvtier bench master`` end to end at a small size: real daemon, real client processes, the JSON schema the
issue asks for, and figures that are consistent with each other."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_master_writes_the_promised_json(tmp_path):
    out = tmp_path / "master.json"
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "master", "--keys", "40000", "--clients", "1,2",
                        "--seconds", "0.5", "--rounds", "1", "--candidates", "4", "--memory", "20000",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert [row["clients"] for row in res["lookup"]] == [1, 2]
    for row in res["lookup"]:
        assert {"clients", "keys_per_s", "p50_ms", "p99_ms"} <= set(row)
        assert row["keys_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["ratio"] == pytest.approx(row["keys_per_s"] / row["baseline_keys_per_s"], abs=1e-3)
    assert 0 < res["cost"]["p50_ms"] <= res["cost"]["p99_ms"]
    assert set(res["bytes_per_entry"]) == {"20000"} and 16 < res["bytes_per_entry"]["20000"] < 1000
    assert res["setup"]["keys"] == 40000
    assert "M keys/s" in r.stdout and "ratio" in r.stdout


@pytest.mark.slow
def test_bench_master_with_shared_masters_beside_the_lmdb_master(tmp_path):
    pytest.importorskip("redis")
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("needs Debian's redis-server (tests/run.sh installs it)")
    out = tmp_path / "shared.json"
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "master", "--keys", "20000", "--clients", "",
                        "--seconds", "0.5", "--rounds", "1", "--candidates", "2", "--memory", "", "--masters", "1,2",
                        "--shared-clients", "2", "--staleness-samples", "20", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    shared = json.loads(out.read_text())["shared"]
    assert [row["setup"] for row in shared["rows"]] == ["lmdb", "redis x1", "redis x2"]
    for row in shared["rows"]:
        assert row["keys_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] and row["keys_per_cpu_s"] > 0
        assert row["baseline_keys_per_s"] == shared["rows"][0]["keys_per_s"]
    assert shared["rows"][0]["ratio"] == 1.0
    st = shared["staleness"]["redis x2"]
    assert 0 < st["visible_p50_ms"] <= st["visible_p99_ms"] and st["write_p50_ms"] > 0
    fo = shared["failover"]
    assert fo["failed_lookups"] == 0 and fo["worst_lookup_s"] >= fo["timeout_s"] * 0.9 and fo["restart_to_serving_s"] > 0
    assert "staleness" in r.stdout and "M keys/CPU-s" in r.stdout and "kill -9" in r.stdout
