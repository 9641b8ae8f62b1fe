"""``--plot FILE.png``: hit rate against DRAM capacity, one line per policy, with OPT and the infinite cache.

matplotlib is a dependency of kvtier; ``require_matplotlib`` is still called before a replay starts, so an
install without it fails in a second, not after the sweep.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.tools.replay.sweep import SweepPoint

GIB = 1024**3


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, a dependency of kvtier: pip install matplotlib") from None


def plot_hit_rates(points: list[SweepPoint], block_bytes: int, path: str | Path, title: str) -> None:
    """Write a PNG. x: DRAM capacity in GiB, ascending."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not points:
        raise ValueError("nothing to plot")
    points = sorted(points, key=lambda p: p.capacity_blocks.get("dram", 0))
    xs = [p.capacity_blocks.get("dram", 0) * block_bytes / GIB for p in points]
    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in points[0].runs:
        ax.plot(xs, [p.runs[name].result.hit_rate for p in points], marker="o", label=name)
    ax.plot(xs, [p.opt_hit_rate for p in points], marker="s", color="black", label="OPT (Belady), HBM + DRAM")
    ax.plot(xs, [p.opt_dram_only_hit_rate for p in points], marker="^", linestyle=":", color="dimgray",
            label="OPT, DRAM alone")
    ax.plot(xs, [p.infinite_hit_rate for p in points], linestyle="--", color="gray", label="infinite cache")
    ax.set_xticks(xs)
    ax.set_xticklabels([p.labels.get("dram", "").replace(" (", "\n(") for p in points], fontsize=8)
    ax.set_xlabel(f"DRAM capacity (HBM {points[0].labels.get('hbm', '')} in front)")
    ax.set_ylabel("hit rate (fraction of input tokens)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path))
    print(f"wrote {path}")
