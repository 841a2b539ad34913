"""Add the live serving path's own costs to an engine-fitted profile.

`tidal profile` times `LLMEngine.step()` alone. A live worker does more per step — encode a
TokenChunk per sequence, publish it on NATS, hand results between the engine thread and its
event loop — and shares the cores with the gateway, dispatcher, NATS and the other workers;
each request also pays the HTTP, gateway and dispatch hops once. Those costs are what made
the first fidelity runs' simulated P50 TTFT and TPOT about half the live ones.

Calibration: requests sent one at a time to the live gateway give the unloaded P50 TTFT;
requests sent one per worker at a time give the P50 TPOT with every worker stepping (on a
CPU host the workers share cores, so a step is slower while the others step too); the
simulator's unloaded baseline with the profile gives the same two numbers. The TPOT gap is
per step, so it goes to `step.overhead_s` (every model); the TTFT gap left after that goes
to `request_overhead_s`. Neither is allowed below zero.

`calibrate_batch` adds what the live path costs per SEQUENCE in a step (each sequence's chunk
encoded and published, the gateway relaying its tokens): groups of `k` requests sent at once give
the live TPOT with k sequences decoding together; the simulator, given the same groups, predicts
it with the profile (already calibrated on single requests). The gap over the k - 1 extra
sequences, g, goes to `decode_per_seq_s`, and g comes off `overhead_s` (not below 0), so a
single sequence's step stays as calibrated: the line through the two live points. Batches grow
under KV pressure, so the pressure check (tidal/bench/fidelity_pressure.py) uses it.
"""
from __future__ import annotations

import msgspec

from loadgen.report.metrics import ReportSummary
from loadgen.sim.profile import CostProfile, StepCost
from loadgen.sim.run import unloaded_baseline
from loadgen.traces.schema import Trace


def _p50(summary: ReportSummary, name: str) -> float:
    stats = getattr(summary, name)
    if stats is None:
        raise ValueError(f"calibration needs {name.upper()} from both runs (outputs of at least 2 tokens)")
    return float(stats.p50)


def calibrate(profile: CostProfile, trace: Trace, live_unloaded: ReportSummary,
              live_parallel: ReportSummary | None = None) -> tuple[CostProfile, list[str]]:
    """`profile` with the live path's per-step and per-request overheads added. The step gap
    comes from `live_parallel` when given (one request per worker at once: CPU workers sharing
    cores step concurrently, as under load), the request gap from `live_unloaded`."""
    sim = unloaded_baseline(trace, profile, sample=20)
    tpot_probe = live_parallel or live_unloaded
    step_gap = max(0.0, _p50(tpot_probe, "tpot") - _p50(sim, "tpot"))
    step = msgspec.structs.replace(profile.step, overhead_s=profile.step.overhead_s + step_gap)
    models = {name: msgspec.structs.replace(c, overhead_s=c.overhead_s + step_gap) for name, c in profile.models.items()}
    stepped = msgspec.structs.replace(profile, step=step, models=models)
    sim2 = unloaded_baseline(trace, stepped, sample=20)
    request_gap = _p50(live_unloaded, "ttft") - _p50(sim2, "ttft")
    overhead = max(0.0, profile.request_overhead_s + request_gap)
    out = msgspec.structs.replace(stepped, request_overhead_s=overhead,
                                  description=profile.description + "; calibrated on the live serving path")
    lines = [
        f"unloaded live: TTFT P50 {_p50(live_unloaded, 'ttft') * 1000:.2f} ms, TPOT P50 "
        f"{_p50(live_unloaded, 'tpot') * 1000:.2f} ms (one per worker at once: TPOT P50 "
        f"{_p50(tpot_probe, 'tpot') * 1000:.2f} ms); engine-only profile: TTFT {_p50(sim, 'ttft') * 1000:.2f} ms, "
        f"TPOT {_p50(sim, 'tpot') * 1000:.2f} ms",
        f"calibrated: step overhead +{step_gap * 1000:.2f} ms (now {step.overhead_s * 1000:.2f} ms), "
        f"request overhead {profile.request_overhead_s * 1000:.2f} -> {overhead * 1000:.2f} ms",
    ]
    return out, lines


def simulated_groups(trace: Trace, profile: CostProfile, n: int, k: int) -> ReportSummary:
    """The simulator's view of `live_unloaded_baseline(..., n, parallel=k)`: the same n records,
    k arriving at once on one idle worker, group after group."""
    from loadgen.report.metrics import summarize_records
    from loadgen.sim.run import BASELINE_GAP_S, simulate
    from loadgen.traces.schema import TraceHeader

    recs = trace.records
    step = max(1, len(recs) // max(n, 1))
    picked = recs[::step][:n]
    timed = [msgspec.structs.replace(r, arrival_s=(j // k) * BASELINE_GAP_S) for j, r in enumerate(picked)]
    groups = Trace(header=TraceHeader(params=trace.header.params, num_records=len(timed),
                                      duration_s=len(timed) * BASELINE_GAP_S), records=timed)
    return summarize_records(simulate(groups, profile, 1, max_run_s=BASELINE_GAP_S).records, per_model=False)


def calibrate_batch(profile: CostProfile, trace: Trace, live_groups: ReportSummary, n: int,
                    k: int) -> tuple[CostProfile, list[str]]:
    """`profile` with the live path's per-sequence step cost added, from `live_groups` (n requests
    sent k at a time to one worker, loadgen.runner.baseline.live_unloaded_baseline)."""
    if k < 2:
        raise ValueError(f"a per-sequence cost needs groups of at least 2 requests, got {k}")
    sim = simulated_groups(trace, profile, n, k)
    gap = max(0.0, (_p50(live_groups, "tpot") - _p50(sim, "tpot")) / (k - 1))
    def shifted(c: StepCost) -> StepCost:
        return msgspec.structs.replace(c, decode_per_seq_s=c.decode_per_seq_s + gap, overhead_s=max(0.0, c.overhead_s - gap))

    step = shifted(profile.step)
    models = {name: shifted(c) for name, c in profile.models.items()}
    out = msgspec.structs.replace(profile, step=step, models=models)
    lines = [f"{k} at once: live TPOT P50 {_p50(live_groups, 'tpot') * 1000:.2f} ms, profile "
             f"{_p50(sim, 'tpot') * 1000:.2f} ms: per-sequence step cost +{gap * 1000:.3f} ms "
             f"(now {step.decode_per_seq_s * 1000:.3f} ms; step overhead {step.overhead_s * 1000:.2f} ms)"]
    return out, lines


__all__ = ["calibrate", "calibrate_batch", "simulated_groups"]
