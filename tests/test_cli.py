import json
import subprocess
import sys

import pytest


def kvtier(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, **kw)


def test_help_lists_subcommands():
    r = kvtier("--help")
    assert r.returncode == 0
    for name in ("bench", "config"):
        assert name in r.stdout


_PROBE = """
import json, sys
from kvtier.tools.cli import build_parser
args = build_parser().parse_args(sys.argv[1:]) if len(sys.argv) > 1 else build_parser()
benches = sorted(m for m in sys.modules if m.startswith("kvtier.bench.") and m != "kvtier.bench.cli")
print(json.dumps({"torch": "torch" in sys.modules, "benches": benches, "keys": getattr(args, "keys", None)}))
"""


def test_bench_modules_load_only_when_chosen():
    """`kvtier --help` must not import every benchmark (and torch with them); a chosen one gets its options."""
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"torch": False, "benches": [], "keys": None}
    r = subprocess.run([sys.executable, "-c", _PROBE, "bench", "master", "--keys", "10"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["keys"] == 10 and "kvtier.bench.master" in got["benches"] and "kvtier.bench.tiers" not in got["benches"]
    r = kvtier("bench", "ssd-eviction", "--help")
    assert r.returncode == 0 and "--traces PATH" in r.stdout


@pytest.mark.slow  # a benchmark
def test_bench_tiers_dram_writes_rows(tmp_path):
    out = tmp_path / "dram.json"
    r = kvtier("bench", "tiers", "--tier", "dram", "--sizes", "64KiB,1MiB", "--total", "8MiB", "--rounds", "1",
               "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    lookups = [x for x in rows if x["tier"] == "lookup"]  # 2,000 present keys in process, beside a set probe
    assert {(x["path"], x["op"]) for x in lookups} == {("in-process", "contains"), ("in-process", "lookup_prefix")}
    assert all(x["p50_us"] > 0 and abs(x["ratio"] - x["baseline_us"] / x["p50_us"]) < 0.01 for x in lookups)
    rows = [x for x in rows if x["tier"] != "lookup"]
    # The store's put and get, and each copy the baseline is the best of (one thread and two), per size.
    copies = {f"copy: {c}" for c in ("np.copyto", "np.copyto 2 threads", "copy_rows 1 thread", "copy_rows 2 threads")}
    assert {(x["path"], x["op"], x["block_bytes"]) for x in rows} == {
        *(("store", op, bb) for op in ("put", "get") for bb in (65536, 2**20)),
        *((c, "copy", bb) for c in copies for bb in (65536, 2**20))}
    for bb in (65536, 2**20):  # the baseline is the fastest candidate's figure (ratios are of unrounded figures)
        assert max(x["ratio"] for x in rows if x["op"] == "copy" and x["block_bytes"] == bb) == 1.0
    for x in rows:
        assert set(x) == {"tier", "path", "op", "block_bytes", "gbps", "baseline_gbps", "ratio"} and x["tier"] == "dram"
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0
        # The ratio is of the unrounded figures; the row's gbps are rounded to 3 decimals (+-0.0005), which on a
        # loaded machine (figures of 0.017 GB/s were seen) moves their quotient by several %, and the ratio is rounded
        # to 3 decimals too (a 2-thread copy waiting for a core ran at 0.013 of the best): allow for both.
        rounding = 0.0005 / x["gbps"] + 0.0005 / x["baseline_gbps"]
        assert x["ratio"] == pytest.approx(x["gbps"] / x["baseline_gbps"], rel=0.01 + rounding, abs=0.0005)
    assert "ratio" in r.stdout and "lookup of 2000 present keys" in r.stdout


def test_config_errors_are_one_line_not_tracebacks():
    r = kvtier("config", "--effective", env={"KVTIER_DRAM_CAPACITY": "lots", "PATH": ""})
    assert r.returncode == 2
    assert "kvtier: error: environment: dram_capacity: not a byte size: 'lots'" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_lists_keys():
    r = kvtier("config")
    assert r.returncode == 0 and "dram_capacity" in r.stdout and "eviction" in r.stdout


@pytest.mark.slow  # a benchmark
def test_bench_tiers_ssd_writes_rows_beside_raw_io(tmp_path):
    out = tmp_path / "ssd.json"
    r = kvtier("bench", "tiers", "--tier", "ssd", "--sizes", "1MiB", "--total", "4MiB", "--rounds", "1",
               "--path", str(tmp_path), "--json", str(out))
    if r.returncode and "cannot do O_DIRECT" in r.stderr:
        import pytest

        pytest.skip(f"the test temp dir has no O_DIRECT: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [(x["tier"], x["op"], x["block_bytes"]) for x in rows] == [("ssd", "put", 2**20), ("ssd", "get", 2**20)]
    for x in rows:
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0 and abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 0.01
    assert not list(tmp_path.glob("kvtier-bench-ssd-*"))  # cleaned up
