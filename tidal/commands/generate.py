"""`tidal generate MODEL_DIR "PROMPT"`: run the engine in-process and print the completion.

The quickest check of a checkpoint (and of an adapter with --adapter). With --ids the
generated token ids are printed on one line instead of the text.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion with the in-process engine")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face checkpoint directory")
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter directory")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message with the chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--pool-gib", type=float, help="memory pool size (default: 2x the checkpoint + 1 GiB on CPU)")
    p.add_argument("--ids", action="store_true", help="print the generated token ids on one line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `tidal --help` does not load torch.
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.model_config import CheckpointError
    from services.gpu_worker.engine.sampling_params import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
        )
        if not Path(args.model_dir).is_dir():
            raise CheckpointError(f"{args.model_dir}: no such model directory")
        pool = int(args.pool_gib * (1 << 30)) if args.pool_gib else None
        engine = LLMEngine(EngineConfig(args.model_dir, dtype=args.dtype, device=args.device, max_num_seqs=1,
                                        max_num_batched_tokens=512, pool_bytes=pool))
        adapter = None
        if args.adapter:
            adapter = "cli-adapter"
            engine.add_lora(adapter, args.adapter)
        prompt: str | list[int] = args.prompt
        if args.chat:
            if engine.tokenizer is None:
                raise CheckpointError(f"{args.model_dir}: --chat needs tokenizer.json")
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        (result,) = engine.generate([prompt], params, adapters=[adapter])
    except (CheckpointError, SamplingParamsError, ValueError, OSError, MemoryError) as exc:
        print(f"tidal generate: {exc}", file=sys.stderr)
        return 2
    if args.ids:
        print(" ".join(str(t) for t in result.token_ids))
    else:
        print(result.text)
    if result.error:
        print(f"tidal generate: {result.error}", file=sys.stderr)
        return 1
    return 0
