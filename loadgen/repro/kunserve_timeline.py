"""The occupancy figures of `tidal repro kunserve`: for the headline point, each system's KV in use
over time (the fullest instance), and its waiting queue split into "waiting for memory" and
"waiting for compute" with the preemptions beside it (loadgen/sim/timeline.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loadgen.repro.kunserve import LABELS, KunConfig, build_trace, simulate
from loadgen.repro.report import timelines


def occupancy_figures(out: Path, cfg: KunConfig, dataset: str, rate: float, seed: int) -> list[str]:
    trace = build_trace(cfg, dataset, rate, seed=seed)
    runs = {s: simulate(cfg, trace, s)[1].samples for s in cfg.systems}
    systems = list(runs)
    times = [np.array([x.t_s for x in runs[s]]) for s in systems]
    where = f"{dataset}, {rate:g} rps, seed {seed}"
    timelines(out / "kv_occupancy.png", [LABELS[s] for s in systems], times,
              [("fullest instance", [100 * np.array([x.kv_used_max for x in runs[s]]) for s in systems]),
               ("cluster", [100 * np.array([x.kv_used for x in runs[s]]) for s in systems]),
               ("demand (in use + queued)", [100 * np.array([x.demand for x in runs[s]]) for s in systems])],
              "% of KV", f"KV occupancy over time ({where})")
    timelines(out / "waiting_split.png", [LABELS[s] for s in systems], times,
              [("waiting for memory", [np.array([x.waiting_memory for x in runs[s]]) for s in systems]),
               ("waiting for compute", [np.array([x.waiting_compute for x in runs[s]]) for s in systems]),
               ("preemptions (cumulative)", [np.array([x.preemptions for x in runs[s]]) for s in systems])],
              "requests", f"Why requests wait ({where})")
    return ["kv_occupancy.png", "waiting_split.png"]


__all__ = ["occupancy_figures"]
