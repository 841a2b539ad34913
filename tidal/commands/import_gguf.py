"""`tidal import-gguf FILE DIR`: a llama.cpp GGUF model as a Hugging Face checkpoint the cluster serves.

Dequantizes every tensor (see services.gpu_worker.engine.gguf_import) and writes config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja and
generation_config.json into DIR. Llama-architecture files with a byte-level BPE vocabulary.
"""
from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import-gguf", help="convert a llama.cpp GGUF file into a Hugging Face checkpoint directory")
    p.add_argument("file", metavar="FILE", help="the .gguf file")
    p.add_argument("dir", metavar="DIR", help="output directory (created; files of the same name are replaced)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the written weights (default float32: the dequantized values exactly)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `tidal --help` does not load torch.
    from services.gpu_worker.engine.gguf_import import GGUFImportError, import_gguf

    started = time.monotonic()
    try:
        out = import_gguf(args.file, args.dir, dtype=args.dtype)
    except GGUFImportError as exc:
        print(f"tidal import-gguf: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tidal import-gguf: cannot write {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"{out} (imported in {time.monotonic() - started:.1f}s)")
    return 0
