"""kvtier bench hybrid-bytes (bench/hybrid_bytes.py): the counts it prints keep their order on any workload."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from kvtier.bench.hybrid_bytes import MODELS, measure, workload  # noqa: E402


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("seed", [0, 1])
def test_per_group_objects_never_store_more_than_packed_or_whole(name, seed):
    args = argparse.Namespace(agents=2, turns=3, sessions=1, system_tokens=700, task_tokens=300, turn_tokens=200,
                              seed=seed)
    row = measure(MODELS[name], workload(args))
    kvtier, packed, whole, engine = (row[f"{k}_bytes_per_token"] for k in ("kvtier", "packed", "whole", "engine"))
    assert 0 < kvtier <= packed <= whole
    assert kvtier <= engine <= whole
    assert kvtier < whole  # a hybrid model's dead windows / states are never all stored
