"""`tidal profile MODEL_DIR [--out FILE]`: fit the simulator's cost model from the real engine.

Runs `LLMEngine` in this process with the worker's settings (block size, batch cap, step
budget, torch threads), times decode steps over a grid of batch sizes and contexts and
prefill steps over prompt lengths (`loadgen/profiler/measure.py`), fits `StepCost`
(`loadgen/profiler/fit.py`), times a memory copy and a loopback TCP stream for the `shm`
and `tcp` links, and writes a profile `tidal sim --profile FILE` loads.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tidal.commands import profile_gpu, profile_lora


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="fit the simulator's cost model from the real engine; writes a profile")
    p.add_argument("model_dir", help="checkpoint directory (config.json + weights); `lora`: CaraServe's LoRA "
                                     "performance models instead (tidal/commands/profile_lora.py); "
                                     "`gpu`: a measured device profile (tidal/commands/profile_gpu.py)")
    p.add_argument("--out", default=None, help="profile file (.json; default profile-<model>.json)")
    p.add_argument("--name", default=None, help="the profile's name (default: the model directory's name)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, as the worker will run (default 1: a 2-core host's CPU worker)")
    p.add_argument("--pool", default="1GiB", help="the worker's memory pool (sets the KV blocks)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32], help="decode batch sizes")
    p.add_argument("--contexts", type=_ints, default=[32, 128, 384], help="decode context per sequence")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per point (median kept)")
    p.add_argument("--prefill", type=_ints, default=[8, 32, 64, 128, 256, 512], help="prompt lengths")
    p.add_argument("--repeats", type=int, default=3, help="prefills timed per length (median kept)")
    p.add_argument("--request-overhead", type=float, default=0.002, metavar="S",
                   help="gateway + dispatch + delivery per request, seconds (not measured here)")
    p.add_argument("--no-links", action="store_true", help="keep the default link numbers")
    profile_lora.add_arguments(p)
    profile_gpu.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadgen.profiler.profile_engine import ProfileSettings, profile_engine
    from loadgen.sim.profile import save_profile
    from shared.config_units import ByteSize

    if args.model_dir == "lora":
        return profile_lora.run_lora(args)
    if args.model_dir == "gpu":
        return profile_gpu.run_gpu(args)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir}: no config.json (not a checkpoint directory)", file=sys.stderr)
        return 2
    try:
        pool = int(ByteSize.parse(args.pool))
    except ValueError as exc:
        print(f"error: --pool: {exc}", file=sys.stderr)
        return 2
    settings = ProfileSettings(
        name=args.name or model_dir.name, threads=args.threads, pool_bytes=pool, block_size=args.block_size,
        max_batch=args.max_batch, max_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
        batches=args.batches, contexts=args.contexts, steps=args.steps, prefill=args.prefill,
        repeats=args.repeats, request_overhead_s=args.request_overhead, links=not args.no_links,
    )
    started = time.perf_counter()
    try:
        profile, report = profile_engine(model_dir, settings)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"profile-{settings.name}.json")
    save_profile(out, profile)
    for line in report:
        print(line)
    print(f"profile {profile.name} written to {out} in {time.perf_counter() - started:.1f} s")
    return 0
