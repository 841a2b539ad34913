"""Report helpers shared by the paper reproductions (`tidal repro ...`): markdown tables,
grouped bar charts with one panel per testbed, timelines (matplotlib, Agg canvas, no pyplot
state) and the default output directory."""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def default_out(paper: str) -> Path:
    """runs/repro-<paper>-<time> under the cwd, absolute (a config written inside it must not re-resolve it)."""
    return (Path("runs") / f"repro-{paper}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def grouped_bars(path: Path, panels: Sequence[str], groups: Sequence[str],
                 series: Sequence[tuple[str, Sequence[Sequence[float]]]], ylabel: str, title: str,
                 percent: bool = False) -> Path:
    """One panel per entry of `panels`; in each, bars per group, one per series.
    `series` is [(name, values[panel][group])]."""
    fig = _figure(6.2 * len(panels), 3.8)
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for p, (ax, panel) in enumerate(zip(axes, panels)):
        for s, (name, values) in enumerate(series):
            vals = np.asarray(values[p], dtype=float) * (100 if percent else 1)
            bars = ax.bar(x + (s - (len(series) - 1) / 2) * width, vals, width, label=name)
            ax.bar_label(bars, fmt="%.0f" if percent else "%.1f", fontsize=6)
        ax.set_xticks(x, groups, fontsize=8)
        ax.set_title(panel, fontsize=9)
        ax.set_ylabel(ylabel + (" (%)" if percent else ""))
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def timelines(path: Path, panels: Sequence[str], times: Sequence[np.ndarray],
              series: Sequence[tuple[str, Sequence[np.ndarray]]], ylabel: str, title: str) -> Path:
    """One panel per entry of `panels`; a step line per series over that panel's times."""
    fig = _figure(6.2 * len(panels), 3.6)
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for p, (ax, panel) in enumerate(zip(axes, panels)):
        for name, values in series:
            ax.step(times[p] / 60.0, values[p], where="post", lw=1.0, label=name)
        ax.set_xlabel("minutes")
        ax.set_ylabel(ylabel)
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path
