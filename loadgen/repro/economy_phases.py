"""Per-phase figures of one arm's run on the phased trace (loadgen/repro/economy_phased.py): each phase's
P99 TTFT, SLO attainment, the preemptions its requests suffered and their queueing (mean TTFT above the
request's unloaded TTFT), so a report shows where memory binds and which arm wins there."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadgen.repro.economy_phased import phase_of
from loadgen.sim.economy_result import EconomyResult


@dataclass(frozen=True)
class PhaseMetrics:
    name: str
    requests: int
    p99_ttft: float
    slo: float
    preemptions: int  # of this phase's requests (a request preempted twice counts 2)
    queueing_s: float  # mean TTFT above the unloaded TTFT (failed requests left out)


def phase_metrics(r: EconomyResult, names: list[str], phase_s: float, slo_scale: float,
                  slo_floor_s: float) -> list[PhaseMetrics]:
    if r.arrival.size != r.ttft.size:
        raise ValueError(f"arm {r.arm}: per-phase figures need every request's arrival ({r.arrival.size} of "
                         f"{r.ttft.size})")
    ph = phase_of(r.arrival, phase_s, len(names))
    slo = np.maximum(slo_scale * r.unloaded_ttft, slo_floor_s)
    out = []
    for k, name in enumerate(names):
        sel = ph == k
        tt = r.ttft[sel]
        ok = ~np.isnan(tt)
        met = np.where(ok, tt <= slo[sel], False)
        out.append(PhaseMetrics(
            name, int(sel.sum()), float(np.percentile(tt[ok], 99)) if ok.any() else math.nan,
            float(met.mean()) if met.size else math.nan, int(r.preempted[sel].sum()) if r.preempted.size else 0,
            float(np.mean(tt[ok] - r.unloaded_ttft[sel][ok])) if ok.any() else math.nan))
    return out


__all__ = ["PhaseMetrics", "phase_metrics"]
