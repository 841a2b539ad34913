"""`tidal bench fidelity --default-cluster`: the running `tidal up` cluster (the README's `make run`)
against `tidal sim --scale-out` on its own config, with a profile measured here, back to back.

Steps: find the running cluster (as `tidal status` does) and its config; take --trace or write the
issue-35 trace (Poisson 2 req/s for 20 s, seed 0, BurstGPT lengths: 35 requests of the default
model); fit the model's profile in process with the workers' engine settings and torch threads
(`tidal profile`'s code, wall clock: the box's load is in both), the instance start included; run
the trace open loop against the gateway while following the workers' stats (which workers ran the
model's requests, and from when); simulate the same trace on the config's workers with its
scale-out (loadgen/sim/scale_out.py). Prints P50/P99 TTFT, P50 TPOT, E2E of both and, last,
sim/live with the goal (P99 TTFT within 20%). Reports under --out: live/, sim/, profile.json.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from pathlib import Path

TRACE_RATE, TRACE_DURATION_S = 2.0, 20.0  # the trace: 35 requests
# the simulator has no timeouts: a request that gives up live has no TTFT to compare. On a loaded 2-core
# box this trace's last requests wait minutes, so the client waits this long (the gateway's own
# [gateway.limits] request_timeout and stream_stall_timeout must be as long: TIDAL__GATEWAY__LIMITS__...)
REQUEST_TIMEOUT_S = 1800.0
PROFILE_POINTS = {"batches": [1, 4, 16], "contexts": [64, 256], "prefill": [64, 256, 1024], "repeats": 1, "steps": 4}


class ServingWatch:
    """Per worker, from the stats on the bus: when it first ran a request of `model` (run clock) and
    the most it ran at once."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.t0_unix = 0.0
        self.first: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.at_start: set[str] = set()  # workers with an instance of the model before the run
        self.bus = None

    async def start(self, nats_url: str) -> "ServingWatch":
        from shared.bus import Bus, BusSettings
        from shared.events import WorkerStats
        from shared.subjects import worker_stats

        self.bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=3.0), service="cli")
        await self.bus.subscribe(worker_stats(), WorkerStats, self._on_stats)
        return self

    async def _on_stats(self, msg, _ctx) -> None:  # type: ignore[no-untyped-def]
        mine = [i for i in msg.instances if i.model == self.model]
        if not self.t0_unix and mine:
            self.at_start.add(msg.worker_id)
        busy = sum(i.running + i.waiting for i in mine)
        if busy and self.t0_unix:
            self.first.setdefault(msg.worker_id, msg.ts - self.t0_unix)
            self.peak[msg.worker_id] = max(self.peak.get(msg.worker_id, 0), busy)

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    def line(self) -> str:
        if not self.first:
            return "no worker reported the model's requests"
        return ", ".join(f"{w} (from {self.first[w]:.1f} s, peak {self.peak[w]})" for w in sorted(self.first))


def _profile(config, model, model_dir: Path, out: Path, colocated: int):  # type: ignore[no-untyped-def]
    """The profile, measured beside `colocated - 1` busy engines of the same settings (busy_peer.py): the
    cluster's other workers on this box, busy as they are through the trace."""
    import subprocess
    import sys

    from loadgen.profiler.profile_engine import ProfileSettings, profile_engine
    from loadgen.sim.profile import save_profile
    from services.gpu_worker.loading import default_threads

    worker = config.workers[0]
    pol = config.policies
    threads = default_threads(config, worker)
    settings = ProfileSettings(
        name=f"{model.name}-here", threads=threads, pool_bytes=int(worker.memory),
        block_size=pol.kv_block_tokens, max_batch=pol.max_batch_size, max_batched_tokens=pol.step_token_budget,
        max_model_len=model.max_context, links=False, **PROFILE_POINTS)
    argv = [sys.executable, "-m", "loadgen.profiler.busy_peer", str(model_dir), str(threads), str(int(worker.memory)),
            str(pol.max_batch_size), str(pol.step_token_budget), str(model.max_context)]
    peers = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(max(0, colocated - 1))]
    try:
        for peer in peers:  # the profile starts when every peer is busy
            if (line := peer.stdout.readline().strip()) != "ready":  # type: ignore[union-attr]
                raise SystemExit(f"tidal bench fidelity: a busy peer engine did not start ({line or 'no output'})")
        profile, lines = profile_engine(model_dir, settings)
    finally:
        for peer in peers:
            peer.stdin.close()  # type: ignore[union-attr]
        for peer in peers:
            try:
                peer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                peer.kill()
    save_profile(out / "profile.json", profile)
    lines.append(f"measured beside {len(peers)} busy engine(s) of the same settings (the cluster's other "
                 f"workers on this box: --colocated {colocated})")
    return profile, lines


async def _live(trace, url: str, nats_url: str, model: str):  # type: ignore[no-untyped-def]
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context

    config = RunnerConfig(url=url, request_timeout_s=REQUEST_TIMEOUT_S)
    watch = await ServingWatch(model).start(nats_url)
    try:
        runner = LoadRunner(trace.records, config, context=served_context(url))
        await asyncio.sleep(1.5)  # a stats round from every worker: the instances serving at the start
        watch.t0_unix = time.time() + config.lead_s
        outcome = await runner.run()
    finally:
        await watch.stop()
    return outcome, watch


def _ms(summary, name: str, q: str) -> float:  # type: ignore[no-untyped-def]
    stats = getattr(summary, name)
    return getattr(stats, q) * 1000 if stats is not None else float("nan")


def run_default(args: argparse.Namespace) -> int:
    from loadgen.report.write import write_report
    from loadgen.runner.bus_watch import find_cluster
    from loadgen.sim.run import simulate
    from loadgen.sim.scale_out import spec_from_config
    from loadgen.sim.profile import load_profile
    from loadgen.traces.generate import generate
    from loadgen.traces.io import read_trace
    from loadgen.traces.schema import PoissonParams
    from shared.config import load_config
    from tidal.bench.output import out_dir

    state, where = find_cluster(args.state)
    if state is None:
        raise SystemExit(f"tidal bench fidelity --default-cluster: no running cluster ({where}); start one with "
                         "`make run` or `tidal up`")
    config = load_config(state.config)
    model = config.models[0]
    model_dir = Path(model.path) if model.path else Path(state.data_dir) / "models" / model.name  # imported by tidal up
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    trace = read_trace(args.trace) if args.trace else generate(PoissonParams(
        seed=args.seed, duration_s=TRACE_DURATION_S, rate=TRACE_RATE, model=model.name, dataset="burstgpt"))
    print(f"cluster: {state.gateway_url} ({where}); {len(config.workers)} workers; trace: {len(trace.records)} "
          f"requests over {trace.header.duration_s:.0f} s")
    print(f"load average before the profile: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.profile:
        profile, lines = load_profile(args.profile), [f"profile: {args.profile}"]
    else:
        colocated = args.colocated if args.colocated is not None else len(config.workers)
        profile, lines = _profile(config, model, model_dir, out, colocated)
    print("\n".join(lines))
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    outcome, watch = asyncio.run(_live(trace, state.gateway_url, state.nats_url, model.name))
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    live = write_report(out / "live", outcome.records, title="fidelity (default cluster): live",
                        extra={"load average": f"{load_before} / {load_after}", "served on": watch.line()})
    # the simulator starts where the live run started: the instances serving then (the floor, or more
    # when an earlier run's are still kept alive), the other workers standing by
    spec = dataclasses.replace(spec_from_config(config, profile.start_s()), initial=max(1, len(watch.at_start)))
    result = simulate(trace, profile, len(config.workers), scale_out=spec)
    scaled = "; ".join(f"{e.worker} decided {e.decided_s:.1f} s, serving {e.serving_s:.1f} s" for e in result.scale_outs)
    sim = write_report(out / "sim", result.records, title="fidelity (default cluster): simulated",
                       extra={"profile": str(args.profile or out / "profile.json"), "scale-out": scaled or "none"})
    print(f"load average before / after the live run: {load_before} / {load_after}; live: "
          f"{live.completed}/{live.requests} ok; served on {watch.line()}")
    print(f"sim: {spec.initial} instance(s) at the start (as live: {', '.join(sorted(watch.at_start)) or 'none seen'}); "
          f"scale-out: {scaled or 'none'} (instance start {profile.start_s():.1f} s)")
    print(f"{'metric':<10} {'live ms':>10} {'sim ms':>10} {'sim/live':>9}")
    ratio = {}
    for name, q in (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("e2e", "p50")):
        a, b = _ms(live, name, q), _ms(sim, name, q)
        ratio[(name, q)] = b / a if a > 0 else float("nan")
        print(f"{q.upper()} {name.upper():<6} {a:>10.1f} {b:>10.1f} {ratio[(name, q)]:>9.2f}")
    failed = live.requests - live.completed
    ok = abs(ratio[("ttft", "p99")] - 1) <= 0.2 and not failed
    print(f"fidelity (default cluster): sim/live P99 TTFT {ratio[('ttft', 'p99')]:.2f}, P50 TTFT "
          f"{ratio[('ttft', 'p50')]:.2f}, P50 TPOT {ratio[('tpot', 'p50')]:.2f} (goal P99 TTFT 0.80-1.20: "
          f"{'met' if ok else 'missed'}{f', not judged: {failed} live requests failed' if failed else ''}); live on {len(watch.first)} worker(s); load {load_before} / {load_after}")
    return 0 if live.completed == live.requests else 1


__all__ = ["ServingWatch", "run_default"]
