"""`tidal make-lora DIR --base MODEL --rank R`: a PEFT-format LoRA adapter with random weights."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-lora", help="write a random PEFT LoRA adapter for a base checkpoint")
    p.add_argument("dir", help="output directory")
    p.add_argument("--base", required=True, help="base model directory (config.json)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,k,v,o", help="comma list of q,k,v,o,gate,up,down")
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2 x rank)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine.checkpoint_gen import make_lora
    from services.gpu_worker.engine.model_config import CheckpointError

    try:
        out = make_lora(args.dir, args.base, rank=args.rank, targets=args.targets.split(","),
                        alpha=args.alpha, seed=args.seed)
    except (ValueError, CheckpointError) as exc:
        print(f"error: {exc}")
        return 2
    print(out)
    return 0
