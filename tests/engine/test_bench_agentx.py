"""``kvtier bench agentx``, short form, on the real vLLM CPU server (two servers one after the other, the tiny
random-weights Llama): 2 sessions for about a minute each. The bench's own JSON must show requests completed
with TTFT recorded, prompt tokens served from kvtier (source ``host``), and fewer prompt tokens computed with
kvtier than by the connector-less engine in the same run (same traces, same seed). The negative control: the
connector-less engine never reports a kvtier source. Its AIPerf export and plot are written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_agentx_short_form(engine_py, tmp_path):
    out = tmp_path / "agentx.json"
    cmd = [sys.executable, "-m", "kvtier", "bench", "agentx", "--python", str(engine_py), "--concurrency", "2",
           "--modes", "none,kvtier", "--duration", "60", "--grace", "15", "--warmup-limit", "90", "--think-cap", "2",
           "--json", str(out), "--aiperf-dir", str(tmp_path / "aiperf"), "--plot", str(tmp_path / "agentx.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {row["mode"]: row for row in doc["rows"]}
    assert set(rows) == {"none", "kvtier"}, doc["unavailable"]
    none, kv = rows["none"], rows["kvtier"]
    for row in (none, kv):
        assert row["requests"]["completed"] >= 4, row
        assert row["ttft_ms"]["p50"] is not None and row["ttft_ms"]["p50"] > 0
        assert row["prompt_tokens"] > 0 and row["server_died_at_s"] is None
    assert kv["kvtier_cached_tokens"] > 0 and kv["prompt_tokens_cached"].get("host", 0) > 0
    assert none["kvtier_cached_tokens"] == 0  # the control: no connector, no kvtier source
    assert kv["prompt_tokens_computed"] < none["prompt_tokens_computed"]
    assert kv["vs_none"]["computed"] < 1
    assert doc["fitting"]["traces"] > 0
    aiperf = json.loads((tmp_path / "aiperf" / "kvtier-c2" / "profile_export_aiperf.json").read_text())
    assert aiperf["time_to_first_token"]["count"] == kv["requests"]["completed"]
    assert (tmp_path / "agentx.png").stat().st_size > 0
    assert "TTFT p50" in r.stdout
