"""A sweep's runs spread over worker processes (``kvtier replay --jobs``, the demo's default) measure exactly
what the same runs measure one after another in this process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.tools.replay.replayer import ReplayConfig
from kvtier.tools.replay.service import ServiceModel
from kvtier.tools.replay.sizing import model_layout, parse_capacities, parse_capacity
from kvtier.tools.replay.sweep import PolicyRun, RunPool, Sweep, run_pool
from kvtier.tools.replay.workload import load_workload

SAMPLE = Path(kvtier.__file__).parent / "sample-traces" / "agentic-cc"


def measured(run: PolicyRun) -> dict:
    """Everything a run reports but its CPU seconds (which differ from run to run anywhere)."""
    out = {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name not in ("result", "opt_cpu_s")}
    res = run.result
    out.update({f.name: getattr(res, f.name) for f in dataclasses.fields(res) if f.name not in ("cpu_s", "ttft_s")})
    out["ttft_s"] = res.ttft_s.tolist()
    out["stream"] = np.asarray(res.stream).tolist()
    return out


@pytest.mark.slow  # two spawned workers import torch: ~10 s of CPU here
def test_runs_in_worker_processes_measure_what_runs_in_this_process_measure(tmp_path):
    workload = load_workload([SAMPLE / "trace_0292.json.gz", SAMPLE / "trace_0427.json.gz"])  # the smallest two
    name, layout, _ = model_layout(None, workload.block_tokens)
    tiers = {"dram_capacity": parse_capacities("10%"), "ssd_capacity": parse_capacities("0,40%")}
    sweep = Sweep(workload, layout, name, parse_capacity("5%"), tiers, ["default", "lru"], ServiceModel(),
                  ReplayConfig(lanes=2), {"ssd_path": str(tmp_path / "ssd")})
    here = sweep.run()
    pool = run_pool(2)
    assert isinstance(pool, RunPool) and pool.jobs == 2 and run_pool(1) is None
    with pool:
        there = sweep.run(pool)
    assert [p.labels for p in there] == [p.labels for p in here]
    assert [p.capacity_blocks for p in there] == [p.capacity_blocks for p in here]
    for a, b in zip(here, there):
        assert list(b.runs) == list(a.runs) == ["default", "lru"]  # the grid's order, not the finishing order
        for policy in a.runs:
            assert measured(b.runs[policy]) == measured(a.runs[policy])
    # Negative control: the comparison tells runs apart (the two policies, the capacities, the SSD).
    runs = [measured(r) for p in here for r in p.runs.values()]
    assert all(runs[i] != runs[j] for i in range(len(runs)) for j in range(i))
