"""The model both fidelity checks run: --model, or a generated 4-layer llama (hidden 256, vocab 2048)."""
from __future__ import annotations

import argparse
from pathlib import Path


def model_dir(args: argparse.Namespace, root: Path) -> str:
    if args.model:
        return str(args.model)
    from services.gpu_worker.engine.checkpoint_gen import make_model

    return str(make_model(root / "model", arch="llama", layers=4, hidden=256, heads=8, kv_heads=2,
                          intermediate=704, vocab=2048, max_position=2048, seed=1))


__all__ = ["model_dir"]
