"""The soak (``kvtier bench soak``, 30 s here, in the slow CI step): a real master, two real pools and 16 client
processes under mixed traffic, a pool and then the master killed with -9 and restarted mid-run. No store call
raises, no hit carries another key's bytes, the cluster serves hits again after each restart, and no daemon's
memory grows."""

from __future__ import annotations

import json

import pytest

from kvtier.tools.cli import main


@pytest.mark.slow
def test_a_cluster_under_mixed_traffic_and_crashes_never_errs_and_never_returns_wrong_bytes(tmp_path):
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--duration", "30", "--clients", "16", "--faults", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["errors"] == 0, r["error_samples"]
    assert r["wrong_bytes"] == 0
    assert rc == 0
    assert r["ops"] > 1000 and r["hits"] > 0
    restarted = {f["restarted"]: f["t_s"] for f in r["faults"] if "restarted" in f}
    killed = {f["killed"]: f["t_s"] for f in r["faults"] if "killed" in f}
    assert set(restarted) == set(killed) == {"pool-0", "master"}
    # the rows between the pool's restart and the master's kill (the soak leaves at least 4 s between them)
    after_pool = [row for row in r["timeline"] if restarted["pool-0"] < row["t_s"] <= killed["master"]]
    assert sum(row["hits"] for row in after_pool) > 0, r["timeline"]  # served again after the pool came back
    for daemon, growth in r["rss_growth_pct_by_daemon"].items():
        assert growth is None or growth < 25, (daemon, growth, r["rss"][daemon][-5:])
    assert r["p99_ms"] is not None
