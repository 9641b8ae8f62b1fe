"""``kvtier bench ssd-eviction``: the key-level SSD eviction study, on a hand-checked trace and the sample."""

import json
import subprocess
import sys
from pathlib import Path

import kvtier
from kvtier.bench import ssd_eviction as study

SAMPLE = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc"


def test_a_repeated_prefix_is_served_from_ssd_as_counted_by_hand(tmp_path):
    # One conversation asks for the same ten blocks twice. DRAM (10% of 10 blocks) holds one: the first pass
    # misses all ten and writes nine to the SSD, the second finds each on the SSD (promoting it evicts block 10
    # once more: the tenth write).
    request = {"in": 640, "out": 1, "hash_ids": list(range(1, 11)), "think_time": 0.0}
    (tmp_path / "t.json").write_text(json.dumps({"block_size": 64, "requests": [request, request]}))
    convs = study.load_conversations([str(tmp_path)], count=5)
    r = study.simulate(convs, lanes=1, dram=1, ssd=study.PerBlock(10, "lru"))
    assert (r["dram_hit"], r["ssd_hit"], r["ssd_writes"], r["writes_per_offered"]) == (0.0, 0.5, 10, 1.0)


def test_cli_runs_on_the_sample_and_missing_traces_are_one_line_errors(tmp_path):
    cmd = [sys.executable, "-m", "kvtier", "bench", "ssd-eviction"]
    r = subprocess.run([*cmd, "--traces", str(SAMPLE), "--conversations", "2", "--lanes", "2", "--ssd", "0.1",
                        "--schemes", "block-lru,segment-fifo+reinsert"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("2 conversations, 2 lanes, working set ") and len(lines) == 3
    assert "block-lru" in lines[1] and "per offered 1.00" in lines[1]  # one write per block offered
    r = subprocess.run([*cmd, "--traces", str(tmp_path / "nope")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip() == f"kvtier: error: {tmp_path / 'nope'}: no such trace file or directory"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "the following arguments are required: --traces" in r.stderr
