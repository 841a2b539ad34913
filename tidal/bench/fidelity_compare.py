"""Live vs simulated under KV pressure: the table, the goals and the summary line of
`tidal bench fidelity --pressure` (no I/O: the run's two summaries and preemption counts in,
lines out).

Error = |sim - live| / live. Goals (issue 17): P50 and P99 TTFT and P50 TPOT within 20%, the
preemption count within 25%. With no live preemption the count cannot be compared by ratio;
the goal then needs the simulator to count none either, and the run did not test pressure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from loadgen.report.metrics import ReportSummary

LATENCY_GOAL = 0.20
PREEMPTION_GOAL = 0.25
GOALS = {"ttft_p50": LATENCY_GOAL, "ttft_p99": LATENCY_GOAL, "tpot_p50": LATENCY_GOAL, "preemptions": PREEMPTION_GOAL}
ROWS = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"), ("e2e", "p50"), ("e2e", "p99"))


@dataclass(frozen=True, slots=True)
class Side:
    """One side of the comparison: its latency summary and what its engine counted."""

    summary: ReportSummary
    preemptions: int
    kv_peak: float  # highest fraction of the KV blocks in use (live: as its stats sampled it)


def error(live: float, sim: float) -> float:
    """|sim - live| / live; nan when live is not a positive number."""
    if not live > 0 or math.isnan(sim):
        return float("nan")
    return abs(sim - live) / live


def latency(summary: ReportSummary, metric: str, pct: str) -> float:
    stats = getattr(summary, metric)
    return float(getattr(stats, pct)) if stats is not None else float("nan")


def errors(live: Side, sim: Side) -> dict[str, float]:
    """Every row's error, keyed "ttft_p50" ...; "preemptions" as described above."""
    out = {f"{m}_{p}": error(latency(live.summary, m, p), latency(sim.summary, m, p)) for m, p in ROWS}
    if live.preemptions > 0:
        out["preemptions"] = abs(sim.preemptions - live.preemptions) / live.preemptions
    else:
        out["preemptions"] = 0.0 if sim.preemptions == 0 else float("inf")
    return out


def goals_met(errs: dict[str, float]) -> dict[str, bool]:
    return {name: not math.isnan(errs[name]) and errs[name] <= goal for name, goal in GOALS.items()}


def _pct(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x * 100:.0f}%")


def table(live: Side, sim: Side) -> list[str]:
    errs = errors(live, sim)
    met = goals_met(errs)
    lines = [f"{'metric':<12} {'live':>10} {'sim':>10} {'error':>7}  goal"]
    for m, p in ROWS:
        key = f"{m}_{p}"
        a, b = latency(live.summary, m, p), latency(sim.summary, m, p)
        goal = f"<= {GOALS[key]:.0%} {'met' if met[key] else 'MISSED'}" if key in GOALS else ""
        lines.append(f"{p.upper()} {m.upper():<8} {a * 1000:>8.1f}ms {b * 1000:>8.1f}ms {_pct(errs[key]):>7}  {goal}")
    lines.append(f"{'preemptions':<12} {live.preemptions:>10} {sim.preemptions:>10} {_pct(errs['preemptions']):>7}  "
                 f"<= {PREEMPTION_GOAL:.0%} {'met' if met['preemptions'] else 'MISSED'}")
    lines.append(f"{'KV peak':<12} {live.kv_peak:>10.0%} {sim.kv_peak:>10.0%}")
    return lines


def summary_line(live: Side, sim: Side) -> str:
    errs = errors(live, sim)
    return (f"bench fidelity: pressure_ttft_p99_err={_pct(errs['ttft_p99'])} "
            f"pressure_tpot_p50_err={_pct(errs['tpot_p50'])} "
            f"preemptions_live={live.preemptions} preemptions_sim={sim.preemptions}")


__all__ = ["GOALS", "Side", "error", "errors", "goals_met", "summary_line", "table"]
