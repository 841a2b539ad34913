"""The `tidal` console command.

Each subcommand lives in its own module under `tidal/commands/` exposing
`register(subparsers)`; the module sets `func` on its parser. Adding a
subcommand is one line in COMMANDS, so parallel work never edits the same code.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# module names under tidal.commands, in help order
COMMANDS: list[str] = [
    "up",
    "down",
    "status",
    "schemas",
    "bench",
    "make_model",
    "make_lora",
    "import_gguf",
    "generate",
    "trace",
    "sim",
    "profile",
    "repro",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="Tidal: elastic multi-LLM, multi-LoRA serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"tidal.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tidal.commands.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


# arguments that name a path on the user's machine, whatever the subcommand
PATH_ARGUMENTS = ("out", "dir", "data_dir", "state")


def resolve_paths(args: argparse.Namespace) -> None:
    """Every path argument made absolute against the cwd the user gave it in, once, here: code further on
    may write it into a config file that resolves relative paths against the file's own folder."""
    for name in PATH_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            setattr(args, name, os.path.abspath(os.path.expanduser(value)))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_paths(args)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
