"""`tidal bench fidelity --device cuda:0|cpu --profile FILE`: the engine on the device against the
simulator on the profile measured there (`tidal profile gpu`).

The profile says which geometry its `llama-8b` step was fitted on (the full 8B in bf16 on a GPU;
fewer layers and a smaller vocabulary on a CPU, and which grid); the same geometry is built here
(random weights made on the device, gpu_profile.start_engine), with the profile's batch cap and
step budget. A Poisson trace of fixed lengths at about half the profile's estimated capacity runs
through that engine open loop (loadgen/profiler/engine_replay.py: requests join when the clock
passes their arrival; on CUDA the clock is each step's wall time, on a CPU its CPU seconds, the
clock the CPU profile was fitted in) and through the simulator on one worker with the profile
(its per-request overhead set to 0: no gateway here). Prints P50/P99 TTFT and TPOT of both and
the errors, and last `bench fidelity (DEVICE): ttft_p50_err=NN% ttft_p99_err=NN% tpot_p50_err=NN%
tpot_p99_err=NN%`; writes fidelity-device.json under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROWS = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"))


def plan_for(profile, device: str):  # type: ignore[no-untyped-def]
    """The profile run's llama-8b plan (its geometry string names it), on this device's kind."""
    from loadgen.profiler.gpu_grids import geometry, plans

    fit = profile.device.fits.get("llama-8b") if profile.device else None
    if fit is None:
        raise ValueError(f"profile {profile.name}: no llama-8b fit (write one with `tidal profile gpu`)")
    cuda = device.startswith("cuda")
    for quick in (False, True):
        plan = next(p for p in plans(cuda, quick) if p.name == "llama-8b")
        if fit.geometry.startswith(geometry(plan.shape, plan.dtype)):
            return plan
    raise ValueError(f"profile {profile.name} was measured on another geometry ({fit.geometry.split(';')[0]}) "
                     f"than --device {device} builds: profile this device first")


def workload(profile, plan, requests: int, seed: int):  # type: ignore[no-untyped-def]
    """A Poisson trace of ~`requests` requests at about half the profile's capacity, lengths within its grid."""
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PoissonParams

    prompt = max(16, max(plan.grid.prefill) // 4)
    output = 64 if plan.grid.max_len > 1024 else 8
    batch = plan.grid.max_batch
    step = profile.step
    service = step.step_s(0, 0, prompt, prompt * prompt) + output * step.step_s(batch, batch * (prompt + output))
    rate = 0.5 * batch / service
    return generate(PoissonParams(seed=seed, duration_s=requests / rate, rate=rate, model="llama-8b",
                                  prompt_tokens=prompt, output_tokens=output)), rate


def errors(live, sim) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from tidal.bench.fidelity_compare import error, latency

    return {f"{m}_{p}": error(latency(live, m, p), latency(sim, m, p)) for m, p in ROWS}


def summary_line(device: str, errs: dict[str, float]) -> str:
    return f"bench fidelity ({device}): " + " ".join(f"{k}_err={100 * v:.0f}%" for k, v in errs.items())


def run_device(args: argparse.Namespace) -> int:
    import msgspec
    import torch

    from loadgen.profiler.engine_replay import replay_engine
    from loadgen.profiler.gpu_profile import free_device, start_engine
    from loadgen.report.metrics import summarize_records
    from loadgen.sim.measured_overlay import resolve_measured
    from loadgen.sim.profile import load_measured
    from loadgen.sim.run import simulate
    from services.gpu_worker.engine.sampling_params import SamplingParams
    from tidal.bench.fidelity_compare import latency
    from tidal.bench.output import out_dir

    device = args.device
    if args.profile is None:
        print("error: --device needs --profile FILE (`tidal profile gpu --device DEVICE --out FILE`)", file=sys.stderr)
        return 2
    try:
        path = resolve_measured(args.profile)
        profile = load_measured(str(path.resolve()))
        plan = plan_for(profile, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {device}: CUDA is not available here", file=sys.stderr)
        return 2
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # as the CPU profile was measured
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    requests = args.requests or (200 if device.startswith("cuda") else 16)
    trace, rate = workload(profile, plan, requests, args.seed)
    print(f"fidelity on {device}: {plan.name} ({plan.reduced or 'full geometry'}), profile {profile.name} ({path}); "
          f"{len(trace.records)} requests, Poisson {rate:.2f}/s, prompt {trace.records[0].prompt_tokens}, "
          f"output {trace.records[0].output_tokens}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tidal-fidelity-device-") as tmp:
        engine, *_ = start_engine(plan, device, None, Path(tmp))
        vocab = engine.runner.cfg.vocab_size
        engine.generate([[min(16, vocab - 1)] * 8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        result = replay_engine(engine, trace, clock="wall" if device.startswith("cuda") else "cpu")
        engine.runner.close()
        del engine
        free_device(device)
    live = summarize_records(result.records, title="engine on the device", per_model=False)
    sim_profile = msgspec.structs.replace(profile, request_overhead_s=0.0)
    sim = summarize_records(simulate(trace, sim_profile, 1).records, title="simulated", per_model=False)
    errs = errors(live, sim)
    print(f"{'metric':<10} {'live ms':>10} {'sim ms':>10} {'error':>7}")
    for m, p in ROWS:
        print(f"{p.upper()} {m.upper():<6} {latency(live, m, p) * 1000:>10.1f} {latency(sim, m, p) * 1000:>10.1f} "
              f"{100 * errs[f'{m}_{p}']:>6.0f}%")
    failed = sum(1 for r in result.records if r.status != "ok")
    (out / "fidelity-device.json").write_text(json.dumps({
        "device": device, "profile": str(path), "requests": len(trace.records), "rate": rate, "failed": failed,
        "live": {f"{m}_{p}": latency(live, m, p) for m, p in ROWS},
        "sim": {f"{m}_{p}": latency(sim, m, p) for m, p in ROWS}, "errors": errs}, indent=2) + "\n")
    print(summary_line(device, errs))
    return 0 if failed == 0 else 1


__all__ = ["plan_for", "run_device", "summary_line", "workload"]
