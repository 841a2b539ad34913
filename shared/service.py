"""The service runtime every `services/<name>/__main__.py` uses.

    from shared.service import Service, parse_settings, run

    def main() -> None:
        settings = parse_settings("dispatcher")            # args + env (see parse_settings)
        service = Service(settings)
        service.add_actor(Dispatcher())
        service.on_start.append(announce_in_registry)      # async hook(service)
        run(service)                                       # uvloop; exits with the service's code

`Service.run()`: configure logs and tracing, connect the bus, serve Prometheus `/metrics` on
its own port, start the actors, answer `tidal.v1.<service>.health` (HealthReply), run the
`on_start` hooks, then wait. On SIGTERM/SIGINT it drains: state becomes `draining`, the
`on_drain` hooks run (e.g. tell the registry to stop routing here), every actor stops
receiving and finishes in-flight work within `drain_timeout_s`, the `on_stop` hooks run, the
bus is drained and closed, and the process exits 0. A second signal cuts the drain short. A
supervised task that escalates makes the service shut down the same way with exit code 1.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from importlib import metadata
from typing import Awaitable, Callable

import msgspec

from shared import metrics
from shared.actors import Actor
from shared.bus import Bus, BusSettings, Delivery, Subscription
from shared.health import HealthReply, HealthRequest, health_subject
from shared.logging import configure_logging, get_logger
from shared.tracing import Tracing, setup_tracing
from shared.wire import Unavailable

__all__ = [
    "Service", "ServiceSettings", "parse_settings", "run", "health_subject", "HealthReply", "HealthRequest",
]

log = get_logger("tidal.service")
Hook = Callable[["Service"], Awaitable[None]]


class ServiceSettings(msgspec.Struct, kw_only=True):
    service: str
    instance: str
    nats_url: str = "nats://127.0.0.1:4222"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: a free port (logged and reported in HealthReply); -1: no metrics server
    log_level: str = "info"
    drain_timeout_s: float = 10.0
    request_timeout_s: float = 5.0
    tracing: str | None = None  # off|console|otlp; None: $TIDAL_TRACING
    config: str | None = None  # the cluster TOML file, for services that read it


def _version() -> str:
    try:
        return metadata.version("tidal-serve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def build_arg_parser(service: str, parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The common options (each defaults from its environment variable)."""
    env = os.environ.get
    parser = parser or argparse.ArgumentParser(prog=f"python -m services.{service}")
    options: list[tuple[str, str, type, str | None, str]] = [
        ("--nats", "TIDAL_NATS_URL", str, "nats://127.0.0.1:4222", "NATS URL"),
        ("--instance", "TIDAL_INSTANCE_ID", str, None, "instance id (default: service-host-pid)"),
        ("--metrics-host", "TIDAL_METRICS_HOST", str, "127.0.0.1", "address of /metrics"),
        ("--metrics-port", "TIDAL_METRICS_PORT", int, "0", "port of /metrics; 0: a free port, -1: off"),
        ("--log-level", "TIDAL_LOG_LEVEL", str, "info", "debug, info, warning, error"),
        ("--drain-timeout", "TIDAL_DRAIN_TIMEOUT_S", float, "10", "seconds to finish in-flight work on SIGTERM"),
        ("--request-timeout", "TIDAL_REQUEST_TIMEOUT_S", float, "5", "default request deadline, seconds"),
        ("--config", "TIDAL_CONFIG", str, None, "the cluster TOML file"),
    ]
    for flag, var, kind, default, text in options:
        value = env(var, default)
        parser.add_argument(flag, type=kind, default=None if value is None else kind(value), help=f"{text} [{var}]")
    parser.add_argument("--tracing", default=env("TIDAL_TRACING"), choices=["off", "console", "otlp"],
                        help="span exporter (default off) [TIDAL_TRACING]")
    return parser


def parse_settings(
    service: str, argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None
) -> ServiceSettings:
    """Parse the common options; a service adds its own by passing a `parser` it extended
    (read them back from `parse_settings.last_args`)."""
    args = build_arg_parser(service, parser).parse_args(argv)
    parse_settings.last_args = args  # type: ignore[attr-defined]
    return ServiceSettings(
        service=service,
        instance=args.instance or f"{service}-{socket.gethostname()}-{os.getpid()}",
        nats_url=args.nats, metrics_host=args.metrics_host, metrics_port=args.metrics_port, log_level=args.log_level,
        drain_timeout_s=args.drain_timeout, request_timeout_s=args.request_timeout, tracing=args.tracing,
        config=args.config,
    )


class Service:
    """One running service process: bus, metrics, actors, health, signals, drain."""

    def __init__(self, settings: ServiceSettings, *, version: str | None = None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.name = settings.service
        self.version = version or _version()
        self.actors: list[Actor] = []
        self.on_start: list[Hook] = []  # after actors and health are up (e.g. announce in the registry)
        self.on_drain: list[Hook] = []  # first thing on shutdown, before actors drain (e.g. mark draining)
        self.on_stop: list[Hook] = []  # after actors drained, before the bus closes (e.g. deregister)
        self.state = "starting"
        self.progress = ""  # what a `starting` service is doing (HealthReply.progress); on_start hooks set it
        self.exit_code = 0
        self.metrics_port: int | None = None
        self.tracing = tracing
        self._bus: Bus | None = None
        self._started = time.monotonic()
        self._stop_requested = asyncio.Event()
        self._force = asyncio.Event()
        self._health_sub: Subscription | None = None

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError(f"service {self.name} is not running")
        return self._bus

    def add_actor(self, actor: Actor) -> Actor:
        self.actors.append(actor)
        return actor

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin a graceful shutdown (what SIGTERM does); a second call cuts the drain short."""
        self.exit_code = max(self.exit_code, exit_code)
        if self._stop_requested.is_set():
            self._force.set()
        self._stop_requested.set()

    def _escalated(self, actor: Actor, task: str, exc: BaseException) -> None:
        log.critical("supervised task escalated; shutting down", actor=actor.name, task=task, error=repr(exc))
        self.request_stop(exit_code=1)

    async def _health(self, _msg: HealthRequest, _ctx: Delivery) -> HealthReply:
        return HealthReply(
            service=self.name, instance=self.settings.instance, version=self.version,
            uptime_s=round(time.monotonic() - self._started, 3), state=self.state,  # type: ignore[arg-type]
            inflight=sum(actor.inflight for actor in self.actors), metrics_port=self.metrics_port,
            progress=self.progress if self.state == "starting" else "",
        )

    async def run(self, *, install_signals: bool = True) -> int:
        """Run until a stop is requested, then drain; returns the exit code."""
        s = self.settings
        configure_logging(s.service, level=s.log_level, instance=s.instance)
        if self.tracing is None:
            self.tracing = setup_tracing(s.service, s.tracing, instance=s.instance, set_global=True)
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        bus_settings = BusSettings.from_env(url=s.nats_url, request_timeout_s=s.request_timeout_s)
        connect = asyncio.ensure_future(Bus.connect(bus_settings, service=s.service, tracing=self.tracing, name=s.instance))
        stop = asyncio.ensure_future(self._stop_requested.wait())
        await asyncio.wait({connect, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not connect.done():  # stopped while NATS was still unreachable
            connect.cancel()
            await asyncio.gather(connect, return_exceptions=True)
            log.info("service stopped before it connected")
            return self.exit_code
        try:
            self._bus = connect.result()
        except Unavailable as exc:
            log.error("service cannot start", error=str(exc))
            return 1
        try:
            if s.metrics_port >= 0:
                self.metrics_port = metrics.start_metrics_server(s.metrics_port, s.metrics_host)
            for actor in self.actors:
                await actor.start(self._bus, on_escalate=self._escalated)
            self._health_sub = await self._bus.subscribe(health_subject(self.name), HealthRequest, self._health)
            await self._run_hooks("on_start", self.on_start, stop_on_error=True)
            if not self._stop_requested.is_set():
                self.state = "ready"
                log.info("service ready", health=health_subject(self.name), metrics_port=self.metrics_port, version=self.version)
            await self._stop_requested.wait()
        except Exception:
            log.exception("service failed; shutting down")
            self.exit_code = 1
        finally:
            await self._shutdown()
        return self.exit_code

    def _on_signal(self, sig: signal.Signals) -> None:
        first = not self._stop_requested.is_set()
        log.info("signal received; draining" if first else "second signal; cutting the drain short", signal=sig.name)
        self.request_stop()

    async def _run_hooks(self, which: str, hooks: list[Hook], *, stop_on_error: bool = False) -> None:
        for hook in hooks:
            try:
                await hook(self)
            except Exception:
                log.exception("service hook failed", hook=which, name=getattr(hook, "__name__", repr(hook)))
                if stop_on_error:
                    self.request_stop(exit_code=1)
                    return

    async def _shutdown(self) -> None:
        self.state = "draining"
        started = time.monotonic()
        await self._run_hooks("on_drain", self.on_drain)
        remaining = max(0.0, self.settings.drain_timeout_s - (time.monotonic() - started))
        drain = asyncio.ensure_future(asyncio.gather(*(a.stop(remaining) for a in self.actors)))
        force = asyncio.ensure_future(self._force.wait())
        await asyncio.wait({drain, force}, return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if not drain.done():  # second signal: give actors no more time
            for actor in self.actors:
                actor.abort()
            await asyncio.gather(drain, return_exceptions=True)
        if drain.exception() is not None or not all(drain.result()):
            log.warning("drain deadline passed with work unfinished", deadline_s=self.settings.drain_timeout_s)
        await self._run_hooks("on_stop", self.on_stop)
        if self._health_sub is not None:
            await self._health_sub.unsubscribe()
        if self._bus is not None:
            await self._bus.close()
        if self.tracing is not None:
            self.tracing.shutdown()
        log.info("service stopped", exit_code=self.exit_code, drain_s=round(time.monotonic() - started, 3))


def run(service: Service) -> None:
    """Run the service on uvloop and exit the process with its exit code."""
    try:
        import uvloop

        code = uvloop.run(service.run())
    except ImportError:  # uvloop is a dependency; plain asyncio still works without it
        code = asyncio.run(service.run())
    sys.exit(code)
