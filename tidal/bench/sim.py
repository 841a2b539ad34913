"""`tidal bench sim`: how fast the simulator runs a long trace on many workers.

Goal (issue 5): an hour-long trace on 60 simulated GPUs in under a minute. The main
figure is the whole trace (MAF-like by default: 4000 adapters, Poisson arrivals, BurstGPT
lengths, the a100-7b profile). The baseline, from the same run, is the same simulator
forced to one event per engine step (the naive design) on a slice of the trace, beside
the normal one-event-per-decode-run mode on the same slice; the last line is the ratio.
"""
from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulator speed: an hour of trace on 60 workers (goal < 60 s)")
    p.add_argument("--trace", default=None, help="a trace file (default: generate a MAF-like one)")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of generated trace")
    p.add_argument("--rate", type=float, default=250.0, help="requests per second of generated trace")
    p.add_argument("--workers", type=int, default=60)
    p.add_argument("--profile", default="a100-7b")
    p.add_argument("--policy", default="least-load")
    p.add_argument("--slice", type=float, default=60.0, help="seconds of trace for the per-step baseline")
    p.set_defaults(func=run)


def _timed(trace, profile, workers: int, policy: str, max_run_s: float):
    from loadgen.sim.simulator import Simulator
    from shared.policy.routing_policies import make_policy

    sim = Simulator(trace, profile, workers, make_policy(policy), max_run_s=max_run_s)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = sim.run()
    return result, time.perf_counter() - wall0, time.process_time() - cpu0


def run(args: argparse.Namespace) -> int:
    import os

    from loadgen.report.metrics import summarize_records
    from loadgen.sim.profile import load_profile
    from loadgen.traces.generate import generate
    from loadgen.traces.io import read_trace
    from loadgen.traces.schema import MAFParams, Trace, TraceHeader

    profile = load_profile(args.profile)
    trace = read_trace(args.trace) if args.trace else generate(
        MAFParams(seed=1, duration_s=args.duration, rate=args.rate, adapters=4000))
    cut = [r for r in trace.records if r.arrival_s < args.slice]
    piece = Trace(header=TraceHeader(params=trace.header.params, num_records=len(cut), duration_s=args.slice),
                  records=cut)
    print(f"trace: {len(trace.records)} requests over {trace.header.duration_s:.0f} s; {args.workers} workers, "
          f"profile {profile.name}, policy {args.policy}; load average {os.getloadavg()[0]:.2f}")
    rows = []
    for name, max_run_s in (("per-step (baseline)", 1e-12), ("per-run (tidal)", 0.5)):
        result, wall, cpu = _timed(piece, profile, args.workers, args.policy, max_run_s)
        rows.append((name, result.stats.events, wall, cpu))
        print(f"  slice {args.slice:.0f} s, {name:<20} {len(cut):>8} req {result.stats.events:>9} events "
              f"{wall:7.2f} s wall {cpu:7.2f} s cpu  {cpu / max(len(cut), 1) * 1e6:6.1f} us cpu/req")
    result, wall, cpu = _timed(trace, profile, args.workers, args.policy, 0.5)
    s = summarize_records(result.records)
    st = result.stats
    print(f"  whole trace, per-run (tidal) {st.requests:>8} req {st.events:>9} events {wall:7.2f} s wall "
          f"{cpu:7.2f} s cpu  {cpu / max(st.requests, 1) * 1e6:6.1f} us cpu/req; "
          f"{st.sim_end_s / wall:.0f} simulated s per wall s")
    if s.ttft and s.tpot:
        print(f"  load check: TTFT P50 {s.ttft.p50 * 1000:.0f} ms P99 {s.ttft.p99 * 1000:.0f} ms, "
              f"TPOT P50 {s.tpot.p50 * 1000:.1f} ms, {st.preemptions} preemptions")
    goal = "met" if wall < 60 else "MISSED"
    base, ours = rows[0], rows[1]
    print(f"goal < 60 s wall for the whole trace: {wall:.1f} s ({goal}); per-step baseline / per-run on the slice: "
          f"{base[3] / max(ours[3], 1e-9):.1f}x cpu, {base[1] / max(ours[1], 1):.1f}x events")
    return 0
