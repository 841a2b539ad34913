"""`tidal status [--config FILE | --data-dir DIR] [--nats URL] [--json]`: services and workers.

Services come from the registry's catalog and from their health replies (every instance
answers `tidal.v1.<service>.health`); workers from the catalog, with liveness as the registry
judged it from heartbeats. Exits 1 when NATS or the registry cannot be reached.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import msgspec

from shared.config import ConfigError, load_config
from shared.config_units import ByteSize
from shared.events.registry import Bucket, CatalogEntry
from shared.events.worker import WorkerState
from shared.health import HealthReply
from shared.subjects import SERVICES
from shared.wire import TidalError
from tidal.run_state import read_state


class ServiceRow(msgspec.Struct, kw_only=True):
    service: str
    instance: str
    host: str = ""
    pid: int = 0
    health: str  # ok | starting | draining | unreachable
    registry_state: str = ""  # the catalog's view (ready, draining, dead, ...); "" if not registered
    uptime_s: float | None = None
    metrics_port: int | None = None


class WorkerRow(msgspec.Struct, kw_only=True):
    worker_id: str
    device: str
    memory_capacity_bytes: int
    liveness: str  # alive | dead
    state: str
    last_heartbeat_age_s: float | None
    host: str = ""
    incarnation: str = ""


class StatusReport(msgspec.Struct, kw_only=True):
    nats_url: str
    registry_reachable: bool
    services: list[ServiceRow] = []
    workers: list[WorkerRow] = []
    error: str | None = None


def resolve_data_dir(args: argparse.Namespace) -> Path | None:
    """--data-dir, else the config's data_dir (default .tidal); None (after printing why) on a bad config."""
    if getattr(args, "data_dir", None):
        return Path(args.data_dir).resolve()
    try:
        return Path(load_config(args.config).cluster.data_dir)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return None


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="services and workers of the running cluster, with liveness")
    parser.add_argument("--config", help="the cluster TOML file it was started with (to find its data_dir)")
    parser.add_argument("--data-dir", help="the cluster's data directory (default: from the config, .tidal)")
    parser.add_argument("--nats", metavar="URL", help="ask this NATS (default: the one `tidal up` recorded)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS", help="per request (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    nats_url = args.nats
    if not nats_url:
        data_dir = resolve_data_dir(args)
        if data_dir is None:
            return 2
        try:
            state = read_state(data_dir)
        except ValueError as exc:
            print(f"tidal status: {exc}", file=sys.stderr)
            return 1
        if state is None:
            print(f"tidal status: no Tidal cluster is running from {data_dir}; start one with `tidal up`, "
                  "or pass --nats URL", file=sys.stderr)
            return 1
        nats_url = state.nats_url
    report = asyncio.run(collect(nats_url, args.timeout))
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")
    else:
        render(report)
    return 0 if report.registry_reachable else 1


async def collect(nats_url: str, timeout: float) -> StatusReport:
    from shared.bus import Bus, BusSettings
    from shared.logging import configure_logging
    from shared.registry_client import RegistryClient
    from tidal.health_probe import gather_health

    configure_logging("cli", level="warning")  # stdout is for the report

    try:
        bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=timeout), service="cli")
    except TidalError as exc:
        return StatusReport(nats_url=nats_url, registry_reachable=False, error=f"NATS unreachable: {exc}")
    try:
        registry = RegistryClient(bus, timeout=timeout)
        error = None
        try:
            services, workers = await registry.list(Bucket.SERVICES), await registry.list(Bucket.WORKERS)
        except TidalError as exc:
            services, workers, error = [], [], f"registry unreachable: {exc}"
        healths = await asyncio.gather(*(gather_health(bus, name, timeout=min(timeout, 0.5)) for name in SERVICES))
        replies = {inst: reply for found in healths for inst, reply in found.items()}
    finally:
        await bus.close()
    return StatusReport(
        nats_url=nats_url, registry_reachable=error is None, error=error,
        services=service_rows(services, replies), workers=worker_rows(workers, time.time()),
    )


def service_rows(entries: list[CatalogEntry], replies: dict[str, HealthReply]) -> list[ServiceRow]:
    health_of = {"ready": "ok", "starting": "starting", "draining": "draining"}
    now = time.time()
    rows: list[ServiceRow] = []
    for entry in entries:
        rec = entry.record
        reply = replies.pop(entry.key, None)
        rows.append(ServiceRow(
            service=rec.service, instance=entry.key, host=rec.host, pid=rec.pid,  # type: ignore[union-attr]
            health=health_of.get(reply.state, reply.state) if reply else "unreachable",
            registry_state=str(rec.state),  # type: ignore[union-attr]
            uptime_s=reply.uptime_s if reply else (now - rec.started_ts if rec.started_ts else None),  # type: ignore[union-attr]
            metrics_port=reply.metrics_port if reply else rec.metrics_port,  # type: ignore[union-attr]
        ))
    for instance, reply in replies.items():  # answering, but not (or no longer) in the catalog
        rows.append(ServiceRow(service=reply.service, instance=instance, health=health_of.get(reply.state, reply.state),
                               uptime_s=reply.uptime_s, metrics_port=reply.metrics_port))
    order = {name: i for i, name in enumerate(SERVICES)}
    rows.sort(key=lambda r: (order.get(r.service, 99), r.instance))
    return rows


def worker_rows(entries: list[CatalogEntry], now: float) -> list[WorkerRow]:
    rows = []
    for entry in entries:
        rec = entry.record
        dead = rec.state == WorkerState.DEAD  # type: ignore[union-attr]
        rows.append(WorkerRow(
            worker_id=entry.key, device=rec.device, memory_capacity_bytes=rec.memory_capacity_bytes,  # type: ignore[union-attr]
            liveness="dead" if dead else "alive", state=str(rec.state), host=rec.host,  # type: ignore[union-attr]
            last_heartbeat_age_s=round(now - rec.last_heartbeat_ts, 3) if rec.last_heartbeat_ts else None,  # type: ignore[union-attr]
            incarnation=rec.incarnation,  # type: ignore[union-attr]
        ))
    return rows


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def render(report: StatusReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"NATS {report.nats_url}" + (f"  [red]{report.error}[/red]" if report.error else ""))
    colour = {"ok": "green", "alive": "green", "draining": "yellow", "starting": "yellow", "unreachable": "red", "dead": "red"}
    services = Table(title="services")
    for column in ("service", "instance", "pid", "health", "registry", "uptime", "metrics"):
        services.add_column(column, overflow="fold")
    for row in report.services:
        c = colour.get(row.health, "white")
        services.add_row(row.service, row.instance, str(row.pid or "-"), f"[{c}]{row.health}[/{c}]", row.registry_state or "-",
                         _age(row.uptime_s), str(row.metrics_port or "-"))
    console.print(services)
    workers = Table(title="workers")
    for column in ("worker", "device", "memory", "liveness", "state", "last heartbeat"):
        workers.add_column(column)
    for w in report.workers:
        c = colour.get(w.liveness, "white")
        workers.add_row(w.worker_id, w.device, ByteSize(w.memory_capacity_bytes).human(), f"[{c}]{w.liveness}[/{c}]",
                        w.state, _age(w.last_heartbeat_age_s) + " ago" if w.last_heartbeat_age_s is not None else "-")
    console.print(workers)
