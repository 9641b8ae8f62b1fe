"""``kvtier replay`` and ``kvtier demo`` as a user runs them: real subprocesses on the shipped sample."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.tools.cli import main

SAMPLE = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc"


def kvtier_cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env)


@pytest.mark.slow  # a benchmark sweep with plots
def test_replay_sweep_writes_json_and_png(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = kvtier_cli("replay", SAMPLE, "--limit", "3", "--lanes", "2", "--hbm", "4GiB", "--dram", "10%,50%",
                   "--policy", "lru,s3fifo", "--json", out, "--plot", png, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "requests per CPU-second" in r.stdout and "OPT" in r.stdout
    rep = json.loads(out.read_text())
    assert set(rep["policies"]) == {"lru", "s3fifo"} and len(rep["points"]) == 2
    assert rep["policies"] == rep["points"][0]["policies"]  # the top level is the first point
    for point in rep["points"]:
        assert set(point["capacities"]) == {"hbm", "dram"}
        for pol in point["policies"].values():
            assert set(pol["tier_hit_rate"]) == {"hbm", "dram"}
            assert pol["hit_rate"] == pytest.approx(sum(pol["tier_hit_rate"].values()))
            assert 0 <= pol["hit_rate"] <= pol["opt_hit_rate"] <= pol["infinite_hit_rate"] <= 1
            assert pol["opt_hit_rate"] <= point["opt_hit_rate"]
            assert pol["tokens"]["computed"] + sum(pol["tokens"]["hit"].values()) == pol["tokens"]["input"]
            assert pol["bytes_loaded"]["dram"] == pol["tokens"]["hit"]["dram"] // 64 * rep["model"]["block_bytes"]
            assert pol["ttft_s"]["p50"] <= pol["ttft_s"]["p90"]
    small, large = (p["policies"]["lru"]["hit_rate"] for p in rep["points"])
    assert large > small  # 50% of the unique blocks holds more than 10%
    assert rep["model"]["block_bytes"] == 8 * 2**20  # llama-3.1-8b, 64-token blocks
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(head[16:20], "big") >= 600


def test_replay_mooncake_jsonl(tmp_path):
    p = tmp_path / "conv.jsonl"
    rows = [{"timestamp": i * 500, "input_length": 512 * (2 + i % 3), "output_length": 10,
             "hash_ids": [0, 1, 2 + i % 3][: 2 + i % 3] + [100 + i]} for i in range(12)]
    p.write_text("".join(json.dumps(x) + "\n" for x in rows))
    out = tmp_path / "m.json"
    r = kvtier_cli("replay", p, "--hbm", "0", "--dram", "1GiB", "--policy", "lru", "--prefill-rate", "100",
                   "--json", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["workload"]["timed"] and rep["replay"]["lanes"] is None
    lru = rep["policies"]["lru"]
    assert lru["hit_rate"] == pytest.approx(lru["infinite_hit_rate"])  # 1 GiB holds all 17 blocks of 64 MiB
    # Arrivals every 0.5 s outrun a 100 tok/s prefill: the queue grows, the server is busy to the end.
    assert lru["ttft_s"]["p90"] > 5 and 0.9 < lru["prefill_utilization"] <= 1.0
    assert lru["saturated"] and "warning: the modeled server is saturated" in r.stderr
    fast = kvtier_cli("replay", p, "--hbm", "0", "--dram", "1GiB", "--policy", "lru", "--no-progress")
    assert fast.returncode == 0 and "saturated" not in fast.stderr  # the negative control: 10K tok/s keeps up


@pytest.mark.parametrize("args, message", [
    (["--policy", "nosuch"], "unknown eviction policy 'nosuch'"),
    (["--dram", "lots"], "not a byte size: 'lots'"),
    (["--dram", "120%"], "a percentage must be in 0..100"),
    (["--set", "dram_capacit=1GiB"], "unknown config key 'dram_capacit'; did you mean dram_capacity"),
    (["--set", "eviction=lru"], "--set eviction: use --policy"),
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--model", "llama-3.1-8b", "--layers", "2"], "either --model or --layers"),
    (["--bandwidth", "dram"], "--bandwidth 'dram': expected KEY=VALUE"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
])
def test_bad_arguments_are_one_line_errors(capsys, args, message):
    assert main(["replay", str(SAMPLE), "--limit", "1", "--no-progress", *args]) == 2  # in-process: fast
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_malformed_trace_names_the_file(tmp_path):
    bad = tmp_path / "trace_9999.json"
    bad.write_text('{"requests": [{"t": 0, "in": 128, "hash_ids": [1, 2]}, {"t": 1, "in": 64}]}')
    r = kvtier_cli("replay", tmp_path, "--no-progress")
    assert r.returncode == 2
    assert r.stderr.strip() == f"kvtier: error: {bad}: requests[1]: missing 'hash_ids' (a list of block ids)"


@pytest.mark.slow
def test_demo_runs_from_an_installed_wheel(tmp_path):
    """`kvtier demo` from a non-editable install: the sample must be inside the wheel."""
    root = Path(__file__).resolve().parents[1]
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(root),
                    "-w", str(wheels)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    *map(str, wheels.glob("kvtier-*.whl"))], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = kvtier_cli("demo", "--no-progress", "--json", tmp_path / "demo.json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert str(target) in r.stdout  # the sample came from the installed copy
    rep = json.loads((tmp_path / "demo.json").read_text())
    assert len(rep["points"]) == 4 and set(rep["policies"]) == {"default", "lru"}
    assert [p["capacities"]["dram"]["label"].split()[0] for p in rep["points"]] == ["2%", "5%", "10%", "25%"]
    best = rep["points"][-1]
    assert best["policies"]["lru"]["hit_rate"] > rep["points"][0]["policies"]["lru"]["hit_rate"]
    at10 = rep["points"][2]["policies"]
    assert at10["default"]["hit_rate"] > at10["lru"]["hit_rate"] + 0.1  # the sample's agents come back
    assert len(rep["tiers"]["points"]) == 4 and "ssd" in rep["tiers"]["points"][-1]["capacities"]
    png = tmp_path / "kvtier-demo.png"  # written where the user ran it, and named
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "kvtier-demo.png" in r.stdout


def test_progress_bars_on_a_terminal(monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["replay", str(SAMPLE), "--limit", "2", "--lanes", "2", "--dram", "10%,25%", "--policy", "lru"]) == 0
    assert "reading traces" in term.getvalue() and "lru hbm=" in term.getvalue()
    assert "requests per CPU-second" in capsys.readouterr().out


def test_replay_ssd_flag_adds_an_ssd_tier_under_dram(tmp_path, capsys):
    out = tmp_path / "ssd.json"
    assert main(["replay", str(SAMPLE), "--limit", "3", "--lanes", "2", "--hbm", "4GiB", "--dram", "5%",
                 "--ssd", "0,60%", "--policy", "lru", "--set", f"ssd_path={tmp_path / 'ssd'}", "--json", str(out),
                 "--no-progress"]) == 0
    without, with_ssd = json.loads(out.read_text())["points"]
    assert with_ssd["capacities"]["ssd"]["label"].startswith("60%") and without["capacities"]["ssd"]["blocks"] == 0
    a, b = without["policies"]["lru"], with_ssd["policies"]["lru"]
    assert a["tier_hit_rate"].get("ssd", 0) == 0 and b["tier_hit_rate"]["ssd"] > 0
    assert b["hit_rate"] <= b["opt_hit_rate"] <= b["infinite_hit_rate"]
    assert not any((tmp_path / "ssd").iterdir())  # each run's directory is removed after it
    assert main(["replay", str(SAMPLE), "--limit", "1", "--ssd", "10%", "--set", "ssd_capacity=5%",
                 "--no-progress"]) == 2
    assert "give the SSD size once: --ssd or --set ssd_capacity" in capsys.readouterr().err
