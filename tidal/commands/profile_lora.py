"""`tidal profile lora`: CaraServe §5's performance models from the real engine (both kernels).

Reached through `tidal profile` (its positional argument is `lora`; a checkpoint directory
named `lora` is `./lora`). Writes a JSON profile that `[dispatcher] lora_profile` and the
simulator's rank-aware routing load; prints each fit's R^2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _kernels(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in ("padded", "segmented")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected padded and/or segmented, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tidal profile lora (CaraServe performance models)")
    g.add_argument("--kernels", type=_kernels, default=("padded", "segmented"), help="padded,segmented")
    g.add_argument("--ranks", type=_ints, default=(8, 16, 32, 64), help="adapter ranks (default 8,16,32,64)")
    g.add_argument("--lora-batches", type=_ints, default=(1, 4, 8, 16), help="decode batch sizes (default 1,4,8,16)")
    g.add_argument("--lora-prompts", type=_ints, default=(32, 128), help="prefill lengths (default 32,128)")
    g.add_argument("--lora-steps", type=int, default=5, help="decode steps timed per point (median; default 5)")
    g.add_argument("--lora-repeats", type=int, default=3, help="prefills timed per point (median; default 3)")
    g.add_argument("--model", default=None, help="checkpoint to profile (default: a generated one, --hidden wide)")
    g.add_argument("--hidden", type=int, default=512, help="width of the generated model (default 512)")


def run_lora(args: argparse.Namespace) -> int:
    from loadgen.profiler.lora import LoraSweep, profile_lora
    from shared.policy.lora_perf_model import encode_profile

    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json (not a checkpoint directory)", file=sys.stderr)
        return 2
    if args.lora_steps < 1 or args.lora_repeats < 1 or args.threads < 1:
        print("error: --lora-steps, --lora-repeats and --threads must be >= 1", file=sys.stderr)
        return 2
    sweep = LoraSweep(kernels=args.kernels, ranks=args.ranks, batches=args.lora_batches, prompts=args.lora_prompts,
                      steps=args.lora_steps, repeats=args.lora_repeats, threads=args.threads, hidden=args.hidden,
                      model_dir=args.model)
    started = time.perf_counter()
    try:
        profile, lines = profile_lora(sweep, name=args.name or "lora")
    except (ValueError, RuntimeError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or "profile-lora.json")
    out.write_bytes(encode_profile(profile))
    for line in lines:
        print(line)
    print(f"LoRA profile {profile.name} written to {out} in {time.perf_counter() - started:.1f} s")
    return 0
