"""Which running cluster a command means: --state DIR (alias --data-dir), TIDAL_STATE, --config, the
default config's data_dir under the cwd, then this user's running clusters (shared/run_locate.py)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shared.run_locate import STATE_ENV, locate

BAD_CONFIG = 2
NOT_RUNNING = 1


def add_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="the cluster TOML file it was started with (to find its data_dir)")
    parser.add_argument("--state", "--data-dir", dest="data_dir", metavar="DIR",
                        help=f"the cluster's data directory, holding run.json (default: ${STATE_ENV}, the config's "
                             "data_dir under this folder, else this user's running cluster)")


def find_cluster(args: argparse.Namespace, command: str) -> Path | int:
    """The running cluster's data directory, or an exit code after saying where it looked (or what is wrong)."""
    config_dir = None
    if not args.data_dir and not os.environ.get(STATE_ENV):
        from shared.config import ConfigError, load_config

        try:
            config_dir = load_config(args.config).cluster.data_dir
        except ConfigError as exc:
            print(str(exc), file=sys.stderr)
            return BAD_CONFIG
    located = locate(args.data_dir, config_dir, search_user=args.config is None)
    if located.data_dir is None:
        print(f"tidal {command}: {located.why_none()}; start one with `tidal up`, or pass --state DIR"
              + (" or --nats URL" if command == "status" else ""), file=sys.stderr)
        return NOT_RUNNING
    return located.data_dir
