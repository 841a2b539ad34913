"""What both fidelity checks run: the model (--model, or a generated 4-layer llama, hidden 256, vocab
2048) and the cluster config around it."""
from __future__ import annotations

import argparse
from pathlib import Path


CONFIG = """
[cluster]
data_dir = "{data}"

[gateway]
port = {port}

[dispatcher]
queue_bound = 4096

[[models]]
name = "fidelity"
path = "{model}"
max_context = {context}

{workers}
[policies]
max_batch_size = {batch}
step_token_budget = {budget}
kv_block_tokens = {block}
scheduling = "{mode}"

[observability]
log_level = "warning"
"""


def model_dir(args: argparse.Namespace, root: Path) -> str:
    if args.model:
        return str(args.model)
    from services.gpu_worker.engine.checkpoint_gen import make_model

    return str(make_model(root / "model", arch="llama", layers=4, hidden=256, heads=8, kv_heads=2,
                          intermediate=704, vocab=2048, max_position=2048, seed=1))


__all__ = ["CONFIG", "model_dir"]
