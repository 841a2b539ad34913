"""`tidal sim` as a function: simulate a trace, write the same report as a live run."""
from __future__ import annotations

from pathlib import Path

import msgspec

from loadgen.report.metrics import ReportSummary, SloSpec, summarize_records
from loadgen.report.write import write_report
from loadgen.sim.occupancy_plot import plot_occupancy
from loadgen.sim.profile import CostProfile
from loadgen.sim.scale_out import ScaleOut, ScaleOutSpec
from loadgen.sim.simulator import SimResult, SimStats, Simulator
from loadgen.traces.schema import Trace, TraceHeader
from shared.policy.lora_routing import RoutingOptions
from shared.policy.routing_policies import make_policy

class SimRunInfo(msgspec.Struct, frozen=True, kw_only=True):
    """sim.json: how a simulated run was made and what the simulator counted."""

    trace: str
    workers: int
    policy: str
    seed: int
    profile: CostProfile
    stats: SimStats
    placement: dict[str, str]  # worker id -> model


BASELINE_SAMPLE = 200
BASELINE_GAP_S = 1e5  # far apart: each request runs alone on an idle worker


def simulate(trace: Trace, profile: CostProfile, workers: int, policy: str = "least-load", seed: int = 0,
             max_run_s: float = 0.5, check_invariants: bool = False,
             options: RoutingOptions | None = None, occupancy_interval_s: float | None = None,
             scale_out: ScaleOutSpec | None = None) -> SimResult:
    """`options`: rank-aware's LoRA model, kernel and SLO (shared.lora_profile_file.routing_options);
    `scale_out`: start with its floor of instances and scale out on saturation (loadgen/sim/scale_out.py)."""
    sim = Simulator(trace, profile, workers, make_policy(policy, seed, options), max_run_s=max_run_s,
                    check_invariants=check_invariants, occupancy_interval_s=occupancy_interval_s,
                    scale_out=ScaleOut(scale_out) if scale_out is not None else None)
    return sim.run()


def unloaded_baseline(trace: Trace, profile: CostProfile, sample: int = BASELINE_SAMPLE) -> ReportSummary:
    """Latencies of (up to) `sample` of the trace's requests, each alone on an idle worker:
    the "unloaded P50" that SLOs of k x P50 refer to (KunServe §5.1)."""
    recs = trace.records
    step = max(1, len(recs) // sample)
    picked = [msgspec.structs.replace(r, arrival_s=j * BASELINE_GAP_S) for j, r in enumerate(recs[::step][:sample])]
    models = sorted({r.model for r in picked})
    alone = Trace(header=TraceHeader(params=trace.header.params, num_records=len(picked),
                                     duration_s=len(picked) * BASELINE_GAP_S), records=picked)
    result = Simulator(alone, profile, len(models), make_policy("least-load"), placement=models,
                       max_run_s=BASELINE_GAP_S).run()
    return summarize_records(result.records, title="unloaded baseline", per_model=False)


def run_and_report(trace: Trace, profile: CostProfile, out_dir: str | Path, *, workers: int,
                   policy: str = "least-load", seed: int = 0, slo: SloSpec | None = None,
                   slo_scale: float | None = None, max_run_s: float = 0.5, save_records: bool = True,
                   plots: bool = True, trace_name: str = "",
                   scale_out: ScaleOutSpec | None = None) -> tuple[SimResult, ReportSummary]:
    baseline = None
    if slo_scale is not None:
        baseline = unloaded_baseline(trace, profile)
        scaled = SloSpec.scaled(slo_scale, baseline)
        slo = SloSpec(ttft_s=scaled.ttft_s, tpot_s=scaled.tpot_s, e2e_s=slo.e2e_s if slo else None)
    duration = trace.header.duration_s or (trace.records[-1].arrival_s if trace.records else 1.0)
    result = simulate(trace, profile, workers, policy, seed, max_run_s, occupancy_interval_s=max(duration / 400, 1e-3),
                      scale_out=scale_out)
    st = result.stats
    extra = {
        "trace": trace_name or "(in memory)",
        "simulated": f"{workers} workers, policy {policy}, profile {profile.name}, seed {seed}, "
                     f"engine mode {profile.worker.engine_mode}",
        **({"scale-out": "; ".join(f"{e.model} on {e.worker}: decided {e.decided_s:.1f} s, serving {e.serving_s:.1f} s "
                                    f"({e.reason})" for e in result.scale_outs) or "none"} if scale_out else {}),
        "simulator": f"{st.events} events, {st.steps} engine steps, {st.preemptions} preemptions, "
                     f"{st.adapter_loads} adapter loads, {st.wall_s:.2f} s wall",
    }
    if baseline is not None and baseline.ttft and baseline.tpot:
        extra["SLO baseline"] = (f"{slo_scale:g} x unloaded P50 (TTFT {baseline.ttft.p50 * 1000:.1f} ms, "
                                 f"TPOT {baseline.tpot.p50 * 1000:.1f} ms)")
    summary = write_report(out_dir, result.records, slo=slo, title="Simulated run", memory=result.memory,
                           extra=extra, save_records=save_records, plots=plots)
    out = Path(out_dir)
    if plots and result.occupancy:
        plot_occupancy(result.occupancy, out / "occupancy.png")
    info = SimRunInfo(trace=trace_name, workers=workers, policy=policy, seed=seed, profile=profile,
                      stats=result.stats, placement=result.placement)
    (out / "sim.json").write_bytes(msgspec.json.format(msgspec.json.encode(info)) + b"\n")
    return result, summary
