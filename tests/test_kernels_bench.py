import json
import subprocess
import sys

import pytest

from kvtier.tools.cli import main as kvtier_main


def kvtier(*args):
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True)


@pytest.mark.slow  # a benchmark
def test_bench_kernels_writes_rows_beside_memcpy(tmp_path):
    out = tmp_path / "kernels.json"
    r = kvtier("bench", "kernels", "--block-sizes", "1,2", "--total", "4MiB", "--rounds", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    cpu = [x for x in rows if x["op"] in ("gather", "scatter")]
    assert {(x["backend"], x["op"], x["block_bytes"]) for x in cpu} >= {
        ("cpu", op, bb) for op in ("gather", "scatter") for bb in (128 * 1024, 256 * 1024)}
    for x in rows:
        assert set(x) == {"backend", "op", "block_bytes", "gbps", "baseline_gbps", "ratio"}
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0
        assert x["ratio"] == pytest.approx(x["gbps"] / x["baseline_gbps"], rel=0.01)  # of unrounded figures
    assert "ratio" in r.stdout and "memcpy" in r.stdout


def test_bench_kernels_bad_arguments_are_one_line_errors(capsys):
    # In this process (the CLI's main, as `kvtier` runs it): two interpreter starts cost ~10 s on a loaded machine,
    # and an exception would fail the test here as surely as a traceback on stderr.
    assert kvtier_main(["bench", "kernels", "--model", "deepseek-v3"]) == 2
    assert "MLA model" in capsys.readouterr().err
    assert kvtier_main(["bench", "kernels", "--backends", "cuda", "--total", "1MiB", "--block-sizes", "1"]) == 2
    assert "backend cuda cannot run here" in capsys.readouterr().err
