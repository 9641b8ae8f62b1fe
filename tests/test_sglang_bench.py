"""``kvtier bench sglang`` runs end to end (real SGLang host pools, the backend from SGLang's factory) and reports
the copies each layout's pages take: one per direction with kvtier DRAM on top; with the node pool on top, one
for one-segment pages and two for pages of 2 or 2L segments. Timings are printed, never asserted."""

from __future__ import annotations

import argparse

import pytest
from sglang_harness import SKIP_REASON, sglang_available

if not sglang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kvtier.bench import sglang as bench  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("standalone", [False, True])
def test_bench_sglang_rows_and_copies(tmp_path, standalone, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--page-size", "16", "--bytes", "8MiB", "--rounds", "1", "--json", str(out),
                              *(["--standalone"] if standalone else [])])
    assert bench.run(args) == 0
    import json

    rows = json.loads(out.read_text())
    assert {(r["pool"], r["layout"]) for r in rows} == {("MHA", x) for x in bench.LAYOUTS["mha"]} | \
        {("MLA", x) for x in bench.LAYOUTS["mla"]}
    for r in rows:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["copies"] == (2 if standalone and r["segments"] > 1 else 1), r
    assert "SGLang HiCache L3 backend" in capsys.readouterr().out


def test_bench_sglang_mamba_state_slots_through_v2(tmp_path):
    """``--pools mamba``: Mamba state slots through batch_set_v2 / batch_get_v2, each byte copied once per
    direction (gathered into / scattered from kvtier's DRAM slot), beside memcpy."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--pools", "mamba", "--state-layers", "2", "--bytes", "8MiB", "--rounds", "1",
                              "--json", str(out)])
    assert bench.run(args) == 0
    import json

    rows = json.loads(out.read_text())
    assert [(r["pool"], r["op"]) for r in rows] == [("MAMBA", "set"), ("MAMBA", "get")]
    for r in rows:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["copies"] == 1 and r["segments"] == 2, r
