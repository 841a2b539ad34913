"""`tidal schemas [--out DIR] [--nats-conf FILE] [--check]`: regenerate (or check) the contracts.

Writes schemas/ (JSON Schema of every message, the subject catalog as SUBJECTS.md and
subjects.json, the config file's schema) and compose/nats.conf from the code. With
`--check` nothing is written; exits 1 naming every stale file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import shared


def project_root() -> Path:
    """The source checkout (where pyproject.toml is) when running from one, else the current directory."""
    root = Path(shared.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def register(sub: argparse._SubParsersAction) -> None:
    root = project_root()
    parser = sub.add_parser("schemas", help="write schemas/ and compose/nats.conf from the code (or --check them)")
    parser.add_argument("--out", type=Path, default=root / "schemas", help="schemas directory (default: %(default)s)")
    parser.add_argument("--nats-conf", type=Path, default=root / "compose" / "nats.conf",
                        help="NATS config with per-role permissions (default: %(default)s)")
    parser.add_argument("--no-nats-conf", action="store_true", help="leave the NATS config alone")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file is stale")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared import schemas_gen

    nats_conf = None if args.no_nats_conf else args.nats_conf
    if args.check:
        problems = schemas_gen.stale(args.out, nats_conf)
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print(f"{len(problems)} file(s) differ from the code: run `tidal schemas`", file=sys.stderr)
            return 1
        print(f"up to date: {args.out}" + (f" and {nats_conf}" if nats_conf else ""))
        return 0
    changed = schemas_gen.write(args.out, nats_conf)
    for path in changed:
        print(f"wrote {path}" if path.exists() else f"removed {path}")
    if not changed:
        print(f"up to date: {args.out}" + (f" and {nats_conf}" if nats_conf else ""))
    return 0
