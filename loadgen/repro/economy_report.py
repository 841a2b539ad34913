"""The economy repro's report: report.md, PNG figures and summary.json under --out."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from loadgen.repro.economy import Headline, Point, best_single, ratio
from loadgen.repro.economy_phased import PHASES
from loadgen.repro.economy_plots import pool_plot, purchases_plot, ttft_cdf
from loadgen.repro.economy_setup import EconomyConfig
from loadgen.repro.report import grouped_bars, md_table
from loadgen.sim.economy_result import ARMS, EconomyResult
from loadgen.sim.economy_state import ABLATIONS
from shared.policy.memory_market import SOURCES

GOAL = "p99_ttft_vs_best_single >= 1.5x at equal GPUs, no phase worse than the best single there (issues 21, 32)"


def _finite(x: object) -> object:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _median(points: list[Point], rate: float, arm: str, key: str) -> float:
    vals = [getattr(p.results[arm], key) for p in points if p.rate == rate and arm in p.results]
    return float(np.median(vals)) if vals else math.nan


def _rows(points: list[Point], arms: list[str]) -> list[list[object]]:
    rows: list[list[object]] = []
    for p in sorted(points, key=lambda p: (p.rate, p.seed)):
        best = best_single(p)
        for arm in arms:
            m = p.results[arm]
            src = "/".join(str(m.by_source.get(s, 0)) for s in SOURCES)
            counts = ", ".join(f"{k} {v}" for k, v in sorted(m.counts.items()) if v)
            rows.append([f"{p.rate:g}", p.seed, arm + (" (best single)" if arm == best else ""), m.requests,
                         f"{m.p50_ttft:.2f}", f"{m.p99_ttft:.2f}", f"{m.slo:.3f}", m.failed, src, counts,
                         f"{m.wall_s:.0f}"])
    return rows


def _ratio_rows(points: list[Point]) -> list[list[object]]:
    rows: list[list[object]] = []
    for rate in sorted({p.rate for p in points}):
        at = [p for p in points if p.rate == rate]
        vs_best = [ratio(p.results[best_single(p)].p99_ttft, p.results["arbiter"].p99_ttft) for p in at]
        vs_fixed = [ratio(p.results["fixed-order"].p99_ttft, p.results["arbiter"].p99_ttft) for p in at]
        lb = [ratio(p.results["arbiter"].p99_ttft, p.results["unbounded"].p99_ttft) for p in at
              if "unbounded" in p.results]
        rows.append([f"{rate:g}", len(at), f"{np.median(vs_best):.2f}x ({min(vs_best):.2f}-{max(vs_best):.2f})",
                     f"{np.median(vs_fixed):.2f}x ({min(vs_fixed):.2f}-{max(vs_fixed):.2f})",
                     f"{np.median(lb):.2f}x" if lb else "-",
                     ", ".join(sorted({best_single(p) for p in at}))])
    return rows


def _trace_text(cfg: EconomyConfig) -> str:
    rates = f"rates {', '.join(f'{r:g}' for r in cfg.rates)} req/s; seeds {', '.join(map(str, cfg.seeds))}."
    if cfg.trace == "phased":
        return (f"Trace: the phased trace (loadgen/repro/economy_phased.py): {', '.join(p.name for p in PHASES)}, "
                f"{cfg.phase_s:g} s each; arrivals and lengths from the Azure LLM inference trace 2023 (CC-BY 4.0; "
                "Patel et al., Splitwise, ISCA 2024), adapters MAF-like (Zipf, "
                f"{cfg.phased_adapters} per adapter model); its history is the same phases from another seed; "
                + rates)
    return (f"Trace: `tidal trace mixed` on the profile's models, {cfg.period_s:g} s replayed after "
            f"{cfg.history_periods} earlier period(s) the forecasters learn from; {cfg.bursts} bursts x"
            f"{cfg.burst_magnitude:g} of {cfg.burst_duration_s:g} s per period; {cfg.adapters_per_model} adapters per "
            f"adapter model (Zipf); {cfg.long_fraction:.0%} long requests; " + rates)


def _phase_rows(points: list[Point], arms: list[str], rate: float) -> list[list[object]]:
    """Per phase and arm at `rate`: median over seeds of P99 TTFT, SLO, preemptions and queueing, P99's range."""
    at = [p for p in points if p.rate == rate and all(p.results[a].phases for a in arms)]
    if not at:
        return []
    rows: list[list[object]] = []
    for k, ph in enumerate(at[0].results[arms[0]].phases):
        for arm in arms:
            got = [p.results[arm].phases[k] for p in at]
            p99 = [g.p99_ttft for g in got]
            rows.append([ph.name, arm, int(np.median([g.requests for g in got])),
                         f"{np.median(p99):.2f} ({min(p99):.2f}-{max(p99):.2f})", f"{np.median([g.slo for g in got]):.3f}",
                         int(np.median([g.preemptions for g in got])), f"{np.median([g.queueing_s for g in got]):.2f}"])
    return rows


def _oracle_section(points: list[Point], cfg: EconomyConfig, head: Headline) -> list[str]:
    """The hindsight oracles (loadgen/repro/economy_oracle.py) per seed at the headline rate, beside the arbiter."""
    at = sorted((p for p in points if p.rate == cfg.headline_rate and p.oracles), key=lambda p: p.seed)
    keys = list(head.oracle_vs_best_single)
    rows = [[p.seed, f"{p.results[head.best_single].p99_ttft:.2f}", f"{p.results['arbiter'].p99_ttft:.2f}",
             *(f"{p.oracles.get(k, math.nan):.2f}" for k in keys),
             f"{p.results['unbounded'].p99_ttft:.2f}" if "unbounded" in p.results else "-"] for p in at]
    return [f"## Hindsight oracles, rate {cfg.headline_rate:g} (P99 TTFT s)", "",
            "Every arm replays the same requests: `phase-switch` takes each phase from the single mechanism best "
            "there; `request-best-single` each request's lowest TTFT among the four single mechanisms; "
            "`request-best-bounded` among every memory-bounded arm (the singles, the fixed order, the arbiter). The "
            "per-request ones are not reachable by one run (each request's best came with other requests' outcomes in "
            "its arm): a goal above them needs, for the trace's slowest requests, TTFTs lower than every one of "
            "these arms gave them; `unbounded` (memory never short) shows what memory itself could give.", "",
            md_table(["seed", f"{head.best_single} (best single)", "arbiter", *keys, "unbounded"], rows), ""]


def write_economy_report(out: Path, points: list[Point], cfg: EconomyConfig, head: Headline,
                         full: dict[str, EconomyResult], *, command: str, wall_s: float, plots: bool = True,
                         notes: list[str] | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in (*ARMS, *ABLATIONS) if all(a in p.results for p in points)]
    rates = sorted({p.rate for p in points})
    figures: list[str] = []
    if plots:
        series = [(a, [[_median(points, r, a, "p99_ttft") for r in rates]]) for a in arms]
        figures.append(grouped_bars(out / "p99_ttft.png", ["median over seeds"], [f"rate {r:g}" for r in rates],
                                    series, "P99 TTFT (s)", "P99 TTFT per arm, equal GPUs").name)
        series = [(a, [[_median(points, r, a, "slo") for r in rates]]) for a in arms]
        figures.append(grouped_bars(out / "slo_attainment.png", ["median over seeds"], [f"rate {r:g}" for r in rates],
                                    series, "SLO attainment", "TTFT SLO attainment per arm", percent=True).name)
        if full:
            shown = [a for a in ("arbiter", "fixed-order", head.best_single) if a in full]
            figures.append(pool_plot(out / "pool_by_kind.png", full, shown).name)
            figures.append(purchases_plot(out / "purchases.png", full, shown).name)
            figures.append(ttft_cdf(out / "ttft_cdf.png", full).name)
    g = head.gpus
    lines = [
        "# The memory economy: the arbiter against each mechanism alone and the fixed order (simulated)", "",
        f"Command: `{command}` — {wall_s:.0f} s wall. Profile `{cfg.profile}` (loadgen/sim/profiles/economy/). "
        + _trace_text(cfg),
        f"SLO: TTFT <= max({cfg.slo_scale:g} x the request's unloaded TTFT, {cfg.slo_floor_s:g} s). "
        "Arms (loadgen/sim/economy_result.py): one mechanism alone (kunserve, mell, caraserve, warmserve), all "
        "four in the planner's fixed order, the arbiter (shared/policy/memory_market.py: every source priced in "
        "request-seconds, cheapest per useful byte first, never dearer than waiting), and `unbounded` (memory "
        "never short: a reference, not a strict bound, as its fleet's start-ups differ). Every arm runs the same "
        "engine (vLLM 0.6 mode), autoscaler and costs.", "",
        "## Headline", "",
        md_table(["metric", "this run", "goal"], [
            [f"P99 TTFT, best single ({head.best_single}: lowest median P99 over the seeds) / arbiter, rate "
             f"{cfg.headline_rate:g} (median of seeds)", f"{head.p99_vs_best_single:.2f}x", ">= 1.5x"],
            ["P99 TTFT, each seed's best single in hindsight / arbiter (median of seeds)",
             f"{head.p99_vs_hindsight:.2f}x", "-"],
            ["P99 TTFT, fixed order / arbiter", f"{head.p99_vs_fixed_order:.2f}x", "-"],
            ["arbiter's SLO attainment", f"{head.slo_attainment:.3f}", "-"],
            [f"GPUs to reach SLO attainment {cfg.slo_target:.2f}: arbiter vs {head.best_single}",
             f"{g.get('arbiter')} vs {g.get(head.best_single)}"
             + ("" if math.isnan(head.gpus_vs_best_single) else f" ({head.gpus_vs_best_single * 100:+.0f}%)"), "-"],
            ["arbiter's P99 TTFT / unbounded memory (reference)", f"{head.lower_bound_gap:.2f}x", "-"],
            *([f"P99 TTFT, best single / hindsight oracle `{k}` (median of seeds; below)", f"{v:.2f}x",
               "above it: no arm's outcome"] for k, v in head.oracle_vs_best_single.items()),
            ["arbiter's own purchases (headline rate, all seeds)", str(head.purchases), "-"],
            ["arbiter's purchases applied (the rest refused: the state moved; or failed in flight)",
             "n/a" if math.isnan(head.applied) else f"{head.applied:.0%}", "-"],
            ["worst phase: best single there / arbiter (median of seeds)",
             f"{head.worst_phase_vs_best_single:.2f}x", ">= 1.0x"],
            ["the shared autoscaler's starts in the arbiter's runs (every arm's base, not purchases)",
             str(head.autoscaler_starts), "-"],
        ]), "", f"`{head.line()}`", "",
        *([f"## Per phase, rate {cfg.headline_rate:g} (median over seeds; P99's range)", "",
           "Phases of the trace (loadgen/repro/economy_phased.py), each "
           f"{cfg.phase_s:g} s. Preemptions: of the phase's requests; queueing: mean TTFT above the request's "
           "unloaded TTFT. `worst_phase_vs_best_single`: per seed, the lowest over the phases of (the best single "
           "arm's P99 in that phase / the arbiter's), median over seeds.", "",
           md_table(["phase", "arm", "requests", "P99 TTFT s", "SLO", "preemptions", "queueing s"],
                    _phase_rows(points, arms, cfg.headline_rate)), ""] if cfg.trace == "phased" else []),
        *(_oracle_section(points, cfg, head) if head.oracle_vs_best_single else []),
        "## Ratios per rate (median over seeds, range)", "",
        md_table(["rate", "seeds", "best single in hindsight / arbiter", "fixed order / arbiter",
                  "arbiter / unbounded", "best single per seed"], _ratio_rows(points)), "",
        "## Every arm, every point", "",
        f"Purchases by source: {'/'.join(SOURCES)}.", "",
        md_table(["rate", "seed", "arm", "requests", "P50 TTFT s", "P99 TTFT s", "SLO", "failed", "purchases",
                  "counts", "wall s"], _rows(points, arms)), "",
    ]
    if notes:
        lines += ["## Why", "", *notes, ""]
    lines += [f"![{f}]({f})" for f in figures]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    summary = {
        "line": head.line(), "headline": dataclasses.asdict(head), "config": dataclasses.asdict(cfg),
        "command": command, "wall_s": wall_s, "goal": GOAL,
        "points": [{"rate": p.rate, "seed": p.seed, "gpus": p.gpus, "oracles": p.oracles,
                    "results": {a: dataclasses.asdict(m) for a, m in p.results.items()}} for p in points],
    }
    (out / "summary.json").write_text(json.dumps(_finite(summary), indent=1) + "\n")
    return out / "report.md"


__all__ = ["GOAL", "write_economy_report"]
