"""The `tidal` console command.

Each subcommand lives in its own module under `tidal/commands/` exposing
`register(subparsers)`; the module sets `func` on its parser. Adding a
subcommand is one line in COMMANDS, so parallel work never edits the same code.

Only the module of the subcommand being run is imported (some pull in torch, the engine, every
benchmark): the others appear in `tidal --help` by the name and summary listed here, which a test
keeps equal to what their modules register.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# module under tidal.commands -> (subcommand name, one-line help), in help order
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("up", "start the cluster (embedded NATS and every service) in the foreground"),
    "down": ("down", "stop the cluster started by `tidal up` (no process is left behind)"),
    "status": ("status", "services, workers and their memory pools, with liveness"),
    "schemas": ("schemas", "write schemas/ and compose/nats.conf from the code (or --check them)"),
    "nats_config": ("nats-config", "write a nats-server config and per-role credentials files"),
    "bench": ("bench", "run a benchmark (prints figures, baseline beside them)"),
    "make_model": ("make-model", "write a small random-weight Llama/Qwen2 checkpoint (HF layout)"),
    "make_lora": ("make-lora", "write a random PEFT LoRA adapter for a base checkpoint"),
    "import_gguf": ("import-gguf", "convert a llama.cpp GGUF file into a Hugging Face checkpoint directory"),
    "generate": ("generate", "generate a completion with the in-process engine"),
    "trace": ("trace", "generate a request trace (JSONL) or import a public one"),
    "sim": ("sim", "simulate a trace on N workers and write the report"),
    "profile": ("profile", "fit the simulator's cost model from the real engine; writes a profile"),
    "repro": ("repro", "reproduce a paper's evaluation in the simulator"),
}

# arguments that name a path on the user's machine, whatever the subcommand
PATH_ARGUMENTS = ("out", "dir", "data_dir", "state")


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (its first word), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, every subcommand's module imported; with `argv`, only the module of the one it names."""
    parser = argparse.ArgumentParser(prog="tidal", description="Tidal: elastic multi-LLM, multi-LoRA serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else _chosen(argv)
    for module_name, (name, summary) in COMMANDS.items():
        if argv is not None and name != chosen:
            sub.add_parser(name, help=summary)  # listed in --help; its module is not needed to run another
            continue
        try:
            module = importlib.import_module(f"tidal.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tidal.commands.{module_name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def resolve_paths(args: argparse.Namespace) -> None:
    """Every path argument made absolute against the cwd the user gave it in, once, here: code further on
    may write it into a config file that resolves relative paths against the file's own folder."""
    for name in PATH_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            setattr(args, name, os.path.abspath(os.path.expanduser(value)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    resolve_paths(args)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`tidal trace ... | head`): stop quietly, as other CLIs do; point stdout at
        # /dev/null so the interpreter's own flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
