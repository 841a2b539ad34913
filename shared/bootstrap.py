"""Start a service process the standard way: options, cluster config, Service, registry announcement.

    from shared.bootstrap import bootstrap
    from shared.service import run

    def main() -> None:
        boot = bootstrap("dispatcher")       # exits 2 with the config module's message on a bad config
        boot.announce()                      # ServiceRecord + heartbeats (see shared.announce)
        run(boot.service)

A bad cluster config is printed exactly as `shared.config` reports it, and the process exits 2
without connecting anywhere.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from shared.announce import Announcer, Catalog
from shared.config import ClusterConfig, ConfigError, WorkerSpec, load_config
from shared.service import Service, parse_settings


@dataclass
class Boot:
    service: Service
    config: ClusterConfig
    args: argparse.Namespace

    def announce(self, *, worker: WorkerSpec | None = None, catalog: Catalog | None = None) -> Announcer:
        return Announcer(
            self.service, heartbeat_interval=float(self.config.registry.heartbeat_interval), worker=worker,
            catalog=catalog,
        ).install()


def bootstrap(service: str, argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None) -> Boot:
    settings = parse_settings(service, argv, parser=parser)
    args = parse_settings.last_args  # type: ignore[attr-defined]
    try:
        config = load_config(settings.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        sys.exit(2)
    return Boot(Service(settings), config, args)


def fail(message: str) -> None:
    """Refuse to start: print why and exit 2 (a usage/config error, not a crash)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
