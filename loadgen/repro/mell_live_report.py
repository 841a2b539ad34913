"""`tidal repro mell --live`: the comparison (live MELL vs the planner off vs the simulator) and its summary line.

Active workers are counted over the *busy* time only (ticks / epochs where at least one worker
holds a request), so the live and simulated runs, whose request lifetimes differ a little, compare
on the same footing. Summary line keys:

* `live_gpus_vs_no_planner`: mean active workers with MELL relative to the planner off (negative: fewer);
* `sim_vs_live_gpus`: the simulator's mean active devices relative to live MELL's;
* `sim_vs_live_peak`: the simulator's peak active devices minus live MELL's;
* `live_util`, `sim_util`: KV in use over the active workers' KV (busy time);
* `migrations`: migrations live MELL applied; `sim_migrations`: the simulator's;
* `lost`: streams, over both live phases, that did not end with every token asked for (must be 0).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadgen.repro.mell_live import LiveRun
from loadgen.repro.report import md_table


@dataclass(frozen=True)
class LiveHeadline:
    gpus_vs_no_planner: float
    sim_vs_live_gpus: float
    sim_vs_live_peak: int
    live_util: float
    sim_util: float
    migrations: int
    sim_migrations: int
    lost: int

    def line(self) -> str:
        return (f"repro mell (live): live_gpus_vs_no_planner={self.gpus_vs_no_planner:+.0%} "
                f"sim_vs_live_gpus={self.sim_vs_live_gpus:+.0%} sim_vs_live_peak={self.sim_vs_live_peak:+d} "
                f"live_util={self.live_util:.0%} sim_util={self.sim_util:.0%} migrations={self.migrations} "
                f"sim_migrations={self.sim_migrations} lost={self.lost}")


def _ratio(a: float, b: float) -> float:
    return a / b - 1 if b > 0 else 0.0


def _mean(values) -> float:  # type: ignore[no-untyped-def]
    return float(values.mean()) if len(values) else 0.0


def live_headline(run: LiveRun) -> LiveHeadline:
    mell, base, sim = run.phases["mell"], run.phases["no-planner"], run.sim
    assert sim is not None
    return LiveHeadline(
        gpus_vs_no_planner=_ratio(_mean(mell.side.busy()), _mean(base.side.busy())),
        sim_vs_live_gpus=_ratio(_mean(sim.busy()), _mean(mell.side.busy())),
        sim_vs_live_peak=int(sim.active.max(initial=0)) - int(mell.side.active.max(initial=0)),
        live_util=mell.side.mean_utilisation(), sim_util=sim.utilisation(),
        migrations=mell.applied(), sim_migrations=sim.migrations,
        lost=sum(p.lost(run.trace) for p in run.phases.values()),
    )


def comparison_rows(run: LiveRun) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, phase in run.phases.items():
        busy = phase.side.busy()
        by_mode = phase.migrations.get("applied", {})
        rows.append([f"live, {'MELL' if name == 'mell' else 'planner off'}", int(phase.side.active.max(initial=0)),
                     round(_mean(busy), 2), f"{phase.side.mean_utilisation():.0%}", phase.applied(),
                     ", ".join(f"{m} {n}" for m, n in sorted(by_mode.items())) or "-",
                     f"{len(run.trace) - phase.lost(run.trace)}/{len(run.trace)}"])
    sim = run.sim
    assert sim is not None
    rows.append(["simulated, MELL (planner core)", int(sim.active.max(initial=0)), round(_mean(sim.busy()), 2),
                 f"{sim.utilisation():.0%}", sim.migrations, "kv (not modelled)", "-"])
    return rows


def comparison_table(run: LiveRun) -> str:
    return md_table(["run", "peak active", "mean active (busy)", "KV util (active)", "migrations", "by mode",
                     "streams complete"], comparison_rows(run))


def write_live_report(out: Path, run: LiveRun, head: LiveHeadline, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg, t = run.config, run.config.trace
    mell = run.phases["mell"]
    assert run.sim is not None
    outcomes = {k: sum(v.values()) for k, v in mell.migrations.items()}
    lines = [
        "# MELL live: a local CPU cluster beside the planner off (run at the same time) and the simulator", "",
        f"Command: `{command}` ({run.wall_s:.0f} s).", "",
        f"{len(run.trace)} requests of {len(t.models)} models over {t.duration_s:.0f} s (Poisson "
        f"{t.rate_per_model}/s per model, {t.long_share:.0%} long, seed {t.seed}); "
        f"{cfg.workers_per_model} CPU workers per model, each with {run.capacity_bytes // run.bytes_per_token} tokens "
        f"of KV ({cfg.memory} pool); planning interval {cfg.interval_s} s, KV high watermark {cfg.watermark}.",
        f"Measured cost (the trace's first {cfg.probe_s:.0f} s, on both clusters before the measured runs; "
        f"MELL's): decode {run.cost.decode_step_s * 1e3:.2f} ms/token, "
        f"prefill {run.cost.prefill_s_per_token * 1e6:.0f} us/token; the simulator uses these.", "",
        comparison_table(run), "",
        (f"The simulator needed devices beyond the live workers (it cannot queue): {extra}." if (extra := {
            m: n for m, n in run.sim.extra_devices.items() if n}) else "The simulator fit in the live workers.") + " "
        f"Live MELL migrations by outcome: {outcomes or 'none'}; by trigger: {mell.triggers or 'none'}. "
        f"Median decode time per token live: " + ", ".join(f"{n} {p.median_tpot_s() * 1e3:.2f} ms"
                                                          for n, p in run.phases.items()) + ".", "",
        "Differences: the simulator moves KV instantly and at once (no transfer time, no view lag), and its request "
        "lifetimes come from the probe's cost at a fixed rate, while live steps slow with the batch and with the other "
        "processes sharing the cores; live the planner sees a request a stats interval after it lands.", "",
        head.line(), "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    summary = {"headline": head.__dict__, "phases": {n: {"active": p.side.active.tolist(),
                                                         "migrations": p.migrations, "triggers": p.triggers}
                                                     for n, p in run.phases.items()},
               "sim": {"active": run.sim.active.tolist() if run.sim is not None else [],
                       "migrations": run.sim.migrations if run.sim is not None else 0}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return out / "report.md"


__all__ = ["LiveHeadline", "comparison_rows", "comparison_table", "live_headline", "write_live_report"]
