"""What every benchmark shares: medians of repeated timings, result rows, the printed table and JSON."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.units import format_bytes


def time_once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s as 1e9 bytes per second (the unit MEASURED.md and the peers use)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def row(fields: dict[str, Any], figure: float, baseline: float) -> dict[str, Any]:
    """One result row: the figure, its physical baseline measured in the same run, and their ratio."""
    return {**fields, "gbps": round(figure, 3), "baseline_gbps": round(baseline, 3),
            "ratio": round(figure / baseline, 3) if baseline else None}


def print_rows(rows: Sequence[dict[str, Any]], title: str, baseline_name: str) -> None:
    print(f"\n{title}  (GB/s = 1e9 B/s, medians; baseline: {baseline_name})")
    keys = [k for k in rows[0] if k not in ("gbps", "baseline_gbps", "ratio")] if rows else []
    text = [{k: str(format_bytes(r[k]) if k == "block_bytes" else r[k]) for k in keys} for r in rows]
    width = {k: max(12, 2 + max(len(k), *(len(t[k]) for t in text))) for k in keys}  # long values stay apart
    header = "".join(f"{k:>{width[k]}}" for k in keys) + f"{'GB/s':>10}{'baseline':>10}{'ratio':>8}"
    print(header)
    for r, t in zip(rows, text):
        cells = "".join(f"{t[k]:>{width[k]}}" for k in keys)
        print(f"{cells}{r['gbps']:>10.2f}{r['baseline_gbps']:>10.2f}{r['ratio']:>8.2f}")


def write_json(rows: Any, path: str | Path | None) -> None:
    if path:
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {path}")
