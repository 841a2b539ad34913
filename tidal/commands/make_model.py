"""`tidal make-model DIR`: a small random-weight checkpoint in the Hugging Face layout."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a small random-weight Llama/Qwen2 checkpoint (HF layout)")
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-position", type=int, default=2048, help="context length (max_position_embeddings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="tie lm_head to the embedding (default: on for qwen2, off otherwise)")
    p.add_argument("--shard-size", type=int, default=None, help="shard safetensors at this many bytes (writes the index)")
    p.add_argument("--sliding-window", type=int, default=None, help="mistral only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine.checkpoint_gen import make_model

    try:
        out = make_model(
            args.dir, arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab, seed=args.seed,
            dtype=args.dtype, max_position=args.max_position, tie_embeddings=args.tie_embeddings,
            shard_size=args.shard_size, sliding_window=args.sliding_window,
        )
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(out)
    return 0
