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
"""
from __future__ import annotations

import msgspec

from loadgen.report.metrics import ReportSummary
from loadgen.sim.profile import CostProfile
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


__all__ = ["calibrate"]
