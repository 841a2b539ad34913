"""PNG plots (matplotlib, Agg canvas, no pyplot state): latency CDFs and a TTFT timeline
with optional per-worker memory by kind and plan events overlaid."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from loadgen.report.metrics import Columns, SloSpec
from loadgen.report.records import MemorySample, PlanMarker

MAX_SCATTER = 20_000  # points drawn on the timeline; percentiles per window cover the rest
MAX_WORKER_LINES = 8  # per-worker memory lines beyond this would hide the stacked kinds


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_cdfs(cols: Columns, path: Path, slo: SloSpec | None = None) -> Path:
    fig = _figure(13, 3.8)
    axes = fig.subplots(1, 3)
    limits = (slo.ttft_s, slo.tpot_s, slo.e2e_s) if slo else (None, None, None)
    for ax, name, values, limit in zip(axes, ("TTFT", "TPOT", "E2E"), (cols.ttft, cols.tpot, cols.e2e), limits):
        v = np.sort(values[cols.ok & ~np.isnan(values)])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        if len(v) == 0:
            continue
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), lw=1.5)
        if v[0] > 0 and v[-1] / v[0] > 100:
            ax.set_xscale("log")
        if limit is not None:
            ax.axvline(limit, color="red", ls="--", lw=1, label=f"SLO {limit * 1000:.0f} ms")
            ax.legend(loc="lower right")
    axes[0].set_ylabel("fraction of requests")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _memory_series(samples: list[MemorySample], grid: np.ndarray) -> dict[tuple[str, str], np.ndarray]:
    """Each (worker, kind) series held as a step function, on the grid."""
    series: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    for s in samples:
        series[(s.worker, s.kind)].append((s.t_s, s.bytes))
    out: dict[tuple[str, str], np.ndarray] = {}
    for key, points in series.items():
        points.sort()
        t = np.array([p[0] for p in points])
        b = np.array([p[1] for p in points], dtype=np.float64)
        idx = np.searchsorted(t, grid, side="right") - 1
        out[key] = np.where(idx >= 0, b[np.clip(idx, 0, None)], 0.0)
    return out


def _memory_by_kind(samples: list[MemorySample], grid: np.ndarray) -> dict[str, np.ndarray]:
    """Memory of each kind summed over workers."""
    totals: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(len(grid)))
    for (_, kind), values in _memory_series(samples, grid).items():
        totals[kind] = totals[kind] + values
    return dict(totals)


def plot_timeline(cols: Columns, path: Path, memory: list[MemorySample] | None = None,
                  plans: list[PlanMarker] | None = None, slo: SloSpec | None = None) -> Path:
    fig = _figure(13, 7 if memory else 4.2)
    axes = fig.subplots(2 if memory else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    sel = cols.ok & ~np.isnan(cols.ttft)
    t, ttft = cols.arrival[sel], cols.ttft[sel]
    if len(t) > MAX_SCATTER:
        pick = np.random.default_rng(0).choice(len(t), MAX_SCATTER, replace=False)
        ax.scatter(t[pick], ttft[pick], s=2, alpha=0.3, label="TTFT (sample)", rasterized=True)
    elif len(t):
        ax.scatter(t, ttft, s=3, alpha=0.5, label="TTFT", rasterized=True)
    if len(t) >= 50:
        edges = np.linspace(t.min(), t.max() + 1e-9, 101)
        which = np.digitize(t, edges) - 1
        mids, p50, p99 = [], [], []
        for w in range(100):
            v = ttft[which == w]
            if len(v):
                mids.append((edges[w] + edges[w + 1]) / 2)
                p50.append(np.percentile(v, 50))
                p99.append(np.percentile(v, 99))
        ax.plot(mids, p50, color="black", lw=1.2, label="P50 per window")
        ax.plot(mids, p99, color="darkred", lw=1.2, label="P99 per window")
    if len(ttft) and ttft.min() > 0 and ttft.max() / ttft.min() > 100:
        ax.set_yscale("log")
    if slo and slo.ttft_s:
        ax.axhline(slo.ttft_s, color="red", ls="--", lw=1, label="TTFT SLO")
    ax.set_ylabel("TTFT (s)")
    ax.grid(alpha=0.3)
    if memory:
        mem_ax = axes[1]
        times = np.array([s.t_s for s in memory])
        grid = np.linspace(times.min(), times.max(), 400)
        by_kind = _memory_by_kind(memory, grid)
        kinds = sorted(by_kind)
        mem_ax.stackplot(grid, [by_kind[k] / 2**30 for k in kinds], labels=kinds, alpha=0.8)
        mem_ax.set_ylabel("memory, all workers (GiB)")
        per_worker: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(len(grid)))
        for (worker, _), values in _memory_series(memory, grid).items():
            per_worker[worker] = per_worker[worker] + values
        if len(per_worker) <= MAX_WORKER_LINES:  # each worker's total, so imbalance shows
            for worker in sorted(per_worker):
                mem_ax.plot(grid, per_worker[worker] / 2**30, lw=0.8, ls="--", label=f"{worker} total")
        mem_ax.legend(loc="upper left", fontsize=8)
        mem_ax.grid(alpha=0.3)
    for p in plans or []:
        for a in axes:
            a.axvline(p.t_s, color="purple", lw=0.8, alpha=0.7)
        ax.annotate(p.label, (p.t_s, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    va="top", ha="right", color="purple")
    ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time (s); TTFT plotted at arrival")
    fig.tight_layout()
    fig.savefig(path)
    return path
