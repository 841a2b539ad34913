"""occupancy.png of a simulated run: each worker's KV in use over time, and the cluster's waiting
queue split into "waiting for memory" and "waiting for compute" with the preemptions beside it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loadgen.sim.timeline import OccupancySample


def plot_occupancy(occupancy: dict[str, list[OccupancySample]], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    kv, wait = fig.subplots(1, 2)
    grid = np.unique(np.concatenate([[s.t_s for s in v] for v in occupancy.values() if v] or [np.zeros(1)]))
    memory = np.zeros_like(grid)
    compute = np.zeros_like(grid)
    preempt = np.zeros_like(grid)
    for worker, samples in sorted(occupancy.items()):
        if not samples:
            continue
        t = np.array([s.t_s for s in samples])
        kv.step(t / 60, [100 * s.kv_used for s in samples], where="post", lw=0.8, label=worker)
        idx = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(t) - 1)
        before = grid < t[0]
        for acc, field in ((memory, "waiting_memory"), (compute, "waiting_compute"), (preempt, "preemptions")):
            vals = np.array([getattr(s, field) for s in samples])[idx]
            vals[before] = 0
            acc += vals
    kv.set(xlabel="minutes", ylabel="% of the worker's KV blocks", title="KV in use")
    if len(occupancy) <= 8:
        kv.legend(fontsize=6)
    wait.step(grid / 60, memory, where="post", label="waiting for memory")
    wait.step(grid / 60, compute, where="post", label="waiting for compute")
    wait.step(grid / 60, preempt, where="post", label="preemptions (cumulative)")
    wait.set(xlabel="minutes", ylabel="requests", title="Why requests wait")
    wait.legend(fontsize=7)
    for ax in (kv, wait):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


__all__ = ["plot_occupancy"]
