"""`tidal status [--config FILE | --data-dir DIR] [--nats URL] [--json] [--watch [SECONDS]]`.

Services come from the registry's catalog and from their health replies (every instance
answers `tidal.v1.<service>.health`); workers from the catalog, with liveness as the registry
judged it from heartbeats, and each live worker's pool, instances and adapters from the
latest `WorkerStats` it published on `tidal.v1.evt.worker.stats` (collected for up to
`--stats-window` seconds, until every live worker has been heard); the memory purchases of the
planner holding the lease from `tidal.v1.planner.purchases` (asked alongside, with a short
timeout: no answer is shown as such, never an error). `--watch` keeps one
connection and redraws in place until Ctrl-C. Exits 1 when NATS or the registry cannot be
reached. The rendering is `status_view.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import msgspec

from shared.events.plan import PurchaseLogReply, PurchaseLogRequest
from shared.events.registry import Bucket, CatalogEntry
from shared.events.worker import WorkerState, WorkerStats
from shared.health import HealthReply
from shared.run_state import read_state
from shared.subjects import SERVICES, planner_purchases, worker_stats
from shared.wire import TidalError
from tidal.commands.cluster_lookup import add_lookup_arguments, find_cluster

RATE_WINDOW_S = 5.0  # --watch: tokens/s over this many seconds of stats reports
FIRST_RATE_S = 0.3  # a single `tidal status` listens this long at least: tokens/s over two reports (250 ms apart)
PURCHASES_SHOWN = 5
PURCHASES_TIMEOUT_S = 0.5  # asked beside the health probes (as long at most): no planner costs no extra time


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
    stats: WorkerStats | None = None  # the latest it published; None when dead or not heard
    stats_age_s: float | None = None
    lifecycle: str | None = None  # WarmServe: idle | universal | dedicated | grace (the planner writes it)
    # per instance: tokens/s averaged over every stats report heard in the status window (a report's own
    # figure covers its last 250 ms, often 0 between bursts)
    tokens_per_s: dict[str, float] = {}


class StatusReport(msgspec.Struct, kw_only=True):
    nats_url: str
    registry_reachable: bool
    services: list[ServiceRow] = []
    workers: list[WorkerRow] = []
    ts: float = 0.0  # when it was made (unix time): what purchase ages count from
    purchases: PurchaseLogReply | None = None  # the lease holder's latest; None: no planner answered
    error: str | None = None


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="services, workers and their memory pools, with liveness")
    add_lookup_arguments(parser)
    parser.add_argument("--nats", metavar="URL", help="ask this NATS (default: the one `tidal up` recorded)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS", help="per request (default: %(default)s)")
    parser.add_argument("--stats-window", type=float, default=1.0, metavar="SECONDS",
                        help="wait this long at most for every live worker's stats (default: %(default)s)")
    parser.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until Ctrl-C")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    nats_url = args.nats
    if not nats_url:
        data_dir = find_cluster(args, "status")
        if isinstance(data_dir, int):
            return data_dir
        try:
            state = read_state(data_dir)
        except ValueError as exc:
            print(f"tidal status: {exc}", file=sys.stderr)
            return 1
        if state is None:  # stopped since it was found
            print(f"tidal status: no Tidal cluster is running from {data_dir}", file=sys.stderr)
            return 1
        nats_url = state.nats_url
    if args.watch is not None:
        if args.watch <= 0:
            print(f"tidal status: --watch takes a positive number of seconds, not {args.watch}", file=sys.stderr)
            return 2
        try:
            asyncio.run(watch(nats_url, args.timeout, args.stats_window, args.watch))
        except KeyboardInterrupt:
            pass
        return 0
    report = asyncio.run(collect(nats_url, args.timeout, args.stats_window))
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")
    else:
        from rich.console import Console

        from tidal.commands.status_view import status_view

        Console().print(status_view(report))
    return 0 if report.registry_reachable else 1


async def collect(nats_url: str, timeout: float, stats_window: float = 1.0) -> StatusReport:
    try:
        source = await StatusSource.open(nats_url, timeout)
    except TidalError as exc:
        return StatusReport(nats_url=nats_url, registry_reachable=False, error=f"NATS unreachable: {exc}")
    try:
        return await source.report(stats_window)
    finally:
        await source.close()


async def watch(nats_url: str, timeout: float, stats_window: float, interval: float) -> None:
    from rich.console import Console
    from rich.live import Live

    from tidal.commands.status_view import status_view

    try:
        source = await StatusSource.open(nats_url, timeout)
    except TidalError as exc:
        raise SystemExit(f"tidal status: NATS unreachable: {exc}") from None
    # Ctrl-C sets an event the loop checks, rather than cancelling the task: on Python 3.11 a
    # cancellation that lands as an inner `wait_for` completes can be lost, and the watch would
    # then run on after Ctrl-C.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        with Live(console=Console(), auto_refresh=False, screen=False) as live:
            window = stats_window
            while not stop.is_set():
                live.update(status_view(await source.report(window)), refresh=True)
                window = 0.0  # the subscription keeps the latest stats from now on
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except asyncio.TimeoutError:
                    pass
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await source.close()


class StatusSource:
    """One NATS connection, the registry, and the latest WorkerStats of every worker heard."""

    def __init__(self, bus: Any, nats_url: str, timeout: float) -> None:
        self.bus = bus
        self.nats_url = nats_url
        self.timeout = timeout
        self.latest: dict[str, WorkerStats] = {}
        self.samples: dict[str, list[tuple[float, dict[str, float]]]] = {}  # worker -> [(ts, instance -> tok/s)]
        self.heard = asyncio.Event()
        self.sub: Any = None
        self.opened = 0.0

    @classmethod
    async def open(cls, nats_url: str, timeout: float) -> "StatusSource":
        from shared.bus import Bus, BusSettings
        from shared.logging import configure_logging

        configure_logging("cli", level="warning")  # stdout is for the report
        bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=timeout), service="cli")
        source = cls(bus, nats_url, timeout)
        source.opened = asyncio.get_running_loop().time()
        source.sub = await bus.subscribe(worker_stats(), WorkerStats, source._on_stats)
        return source

    async def _on_stats(self, msg: WorkerStats, _ctx: object) -> None:
        prev = self.latest.get(msg.worker_id)
        if prev is None or msg.ts >= prev.ts:
            self.latest[msg.worker_id] = msg
        kept = self.samples.setdefault(msg.worker_id, [])
        kept.append((msg.ts, {i.instance_id: i.tokens_per_s for i in msg.instances}))
        del kept[:-64]
        self.heard.set()

    def rates(self, window_s: float) -> dict[str, dict[str, float]]:
        """worker -> instance -> tokens/s, the mean of the reports of its last `window_s` seconds (each report's
        figure covers one stats interval, so the mean of consecutive ones is tokens over their span)."""
        out: dict[str, dict[str, float]] = {}
        for worker, kept in self.samples.items():
            newest = max(ts for ts, _ in kept)
            recent = [rates for ts, rates in kept if ts >= newest - window_s]
            out[worker] = {inst: sum(r.get(inst, 0.0) for r in recent) / len(recent)
                           for inst in recent[-1]}
        return out

    async def close(self) -> None:
        await self.bus.close()

    async def report(self, stats_window: float) -> StatusReport:
        from shared.registry_client import RegistryClient
        from tidal.health_probe import gather_health

        registry = RegistryClient(self.bus, timeout=self.timeout)
        error = None
        try:
            services, workers = await registry.list(Bucket.SERVICES), await registry.list(Bucket.WORKERS)
        except TidalError as exc:
            services, workers, error = [], [], f"registry unreachable: {exc}"
        alive = {e.key for e in workers if e.record.state != WorkerState.DEAD}  # type: ignore[union-attr]
        heard = asyncio.ensure_future(self._await_stats(alive, stats_window))
        purchases = asyncio.ensure_future(self.purchase_log())
        registered = {name: {e.key for e in services if e.record.service == name} or None  # type: ignore[union-attr]
                      for name in SERVICES}  # answered by all of them: no need to wait out the timeout
        healths = await asyncio.gather(*(gather_health(self.bus, n, timeout=min(self.timeout, 0.5),
                                                       expect=registered[n]) for n in SERVICES))
        await heard
        purchase_log = await purchases
        replies = {inst: reply for found in healths for inst, reply in found.items()}
        rows = worker_rows(workers, self.latest, time.time())
        rates = self.rates(RATE_WINDOW_S)
        for row in rows:
            row.tokens_per_s = rates.get(row.worker_id, {}) if row.stats is not None else {}
        return StatusReport(nats_url=self.nats_url, registry_reachable=error is None, error=error,
                            services=service_rows(services, replies), workers=rows, ts=time.time(),
                            purchases=purchase_log)

    async def purchase_log(self) -> PurchaseLogReply | None:
        """The lease holder's latest purchases; None when no planner answers in time (none runs, no
        leader, or one too old to know the subject): status shows that, it is no failure."""
        try:
            return await self.bus.request(planner_purchases(), PurchaseLogRequest(limit=PURCHASES_SHOWN),
                                          PurchaseLogReply, timeout=min(self.timeout, PURCHASES_TIMEOUT_S))
        except TidalError:
            return None

    async def _await_stats(self, alive: set[str], window: float) -> None:
        """Until every live worker has published stats once, or `window` seconds; and (the first time)
        FIRST_RATE_S after the subscription at least, for more than one report's tokens/s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window
        if window > 0 and alive:
            await asyncio.sleep(max(0.0, self.opened + min(FIRST_RATE_S, window) - loop.time()))
        while not alive <= self.latest.keys() and loop.time() < deadline:
            self.heard.clear()
            try:
                await asyncio.wait_for(self.heard.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break


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


def worker_rows(entries: list[CatalogEntry], latest: dict[str, WorkerStats], now: float) -> list[WorkerRow]:
    rows = []
    for entry in entries:
        rec = entry.record
        dead = rec.state == WorkerState.DEAD  # type: ignore[union-attr]
        stats = None if dead else latest.get(entry.key)
        rows.append(WorkerRow(
            worker_id=entry.key, device=rec.device, memory_capacity_bytes=rec.memory_capacity_bytes,  # type: ignore[union-attr]
            liveness="dead" if dead else "alive", state=str(rec.state), host=rec.host,  # type: ignore[union-attr]
            last_heartbeat_age_s=round(now - rec.last_heartbeat_ts, 3) if rec.last_heartbeat_ts else None,  # type: ignore[union-attr]
            incarnation=rec.incarnation, lifecycle=rec.lifecycle,  # type: ignore[union-attr]
            stats=stats, stats_age_s=round(max(0.0, now - stats.ts), 3) if stats is not None else None,
        ))
    return rows
