"""`tidal up [--config FILE] [--nats URL]`: start the cluster in the foreground (see tidal.launcher).

Without --nats (and with `cluster.nats_url = "embedded"`), an embedded nats-server with
JetStream starts on a free port on 127.0.0.1, its store under `<data_dir>/nats`. With --nats
the services join that NATS (a NATS cluster spanning hosts is how Tidal scales past one
host; `--services` and `--workers` start only part of the cluster on this host), each as its own
user with `--nats-credentials DIR` (tidal/nats_access.py).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from shared.config import ConfigError, load_config


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("up", help="start the cluster (embedded NATS and every service) in the foreground")
    parser.add_argument("--config", help="cluster TOML file (default: the embedded default config)")
    parser.add_argument("--nats", metavar="URL", help="join this NATS instead of starting the embedded one "
                        "(comma-separated servers for a NATS cluster)")
    parser.add_argument("--nats-credentials", metavar="DIR", default=os.environ.get("TIDAL_NATS_CREDENTIALS"),
                        help="with --nats: a folder of per-role credentials files (`tidal nats-config` writes them); "
                             "each service connects as its own role, `tidal up` as cli [TIDAL_NATS_CREDENTIALS]")
    parser.add_argument("--services", type=_csv, metavar="LIST",
                        help="start only these services (comma-separated; default: all six)")
    parser.add_argument("--workers", type=_csv, metavar="LIST",
                        help="start only these workers' gpu_worker processes (comma-separated ids)")
    parser.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                        help="how long each service may take to answer health at start (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)  # a bad file starts nothing
        return 2
    if args.nats_credentials and not args.nats and cfg.cluster.embedded_nats:
        print("tidal up: --nats-credentials needs a NATS of your own (--nats URL or cluster.nats_url); the embedded "
              "one makes its own users", file=sys.stderr)
        return 2
    from shared.logging import configure_logging
    from tidal.launch_plan import plan_children
    from tidal.launcher import Launcher

    configure_logging("cli", level=cfg.observability.log_level if cfg.observability.log_level != "info" else "warning")

    try:  # refuse unknown --services / --workers before starting anything
        plan_children(cfg, nats_url="nats://127.0.0.1:4222", config_path=None, run_id="check", logs_dir=Path("."),
                      services=args.services, workers=args.workers)
    except ValueError as exc:
        print(f"tidal up: {exc}", file=sys.stderr)
        return 2
    launcher = Launcher(
        cfg, config_path=str(Path(args.config).resolve()) if args.config else None, nats_url=args.nats,
        services=args.services, workers=args.workers, wait_s=args.wait, out=lambda line: print(line, flush=True),
        nats_credentials=args.nats_credentials,
    )
    try:
        return asyncio.run(launcher.run())
    except Exception as exc:  # start-up failed; what had started was stopped on the way out
        print(f"tidal up: failed: {exc!r}", file=sys.stderr)
        return 1
