"""The gateway process: uvicorn (httptools, on the service's uvloop) inside the Tidal service runtime.

Start: the catalog actor watches the registry, the hub subscribes to token chunks, then the
HTTP socket is bound (a bind failure stops the service with a clear error) and served.
SIGTERM (the runtime's drain): the service state turns `draining` at once, so `/ready` and
new `/v1/` requests answer 503; in-flight generations finish until the drain deadline, the
ones still running are then aborted (their clients get an in-stream error), uvicorn closes,
the bus drains, and the process exits 0.
"""
from __future__ import annotations

import asyncio
import socket
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from services.gateway.app import build_app
from services.gateway.catalog import ModelCatalog
from services.gateway.residency import ResidencyWatch
from services.gateway.hub import Mode, StreamHub
from services.gateway.state import GatewayState
from shared.config import ClusterConfig
from shared.logging import get_logger
from shared.service import Service

log = get_logger("tidal.gateway")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the service runtime owns SIGTERM/SIGINT."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class GatewayServer:
    def __init__(self, service: Service, config: ClusterConfig, *, host: str, port: int,
                 hub_mode: Mode = "wildcard") -> None:
        self.service = service
        self.host = host
        self.port = port
        self.hub_mode = hub_mode
        self.catalog = service.add_actor(ModelCatalog())  # type: ignore[assignment]
        self.state = GatewayState(config, self.catalog, is_draining=lambda: service.state == "draining")  # type: ignore[arg-type]
        service.add_actor(ResidencyWatch(self.state.residency))
        self.app = build_app(self.state)
        self.server: _Uvicorn | None = None
        self.sock: socket.socket | None = None
        self._serving: asyncio.Future[None] | None = None
        service.on_start.append(self._start)
        service.on_drain.append(self._drain)
        service.on_stop.append(self._stop)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _start(self, service: Service) -> None:
        hub = StreamHub(service.bus, mode=self.hub_mode, submit_timeout_s=service.settings.request_timeout_s)
        await hub.start()
        self.state.hub = hub
        self.sock = bind(self.host, self.port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, http="httptools", loop="none", lifespan="off", log_config=None, access_log=False,
            server_header=False, timeout_graceful_shutdown=2, timeout_keep_alive=30,
        )
        config.load()
        self.server = _Uvicorn(config)
        self.server.lifespan = config.lifespan_class(config)  # what uvicorn's own serve() sets up
        await self.server.startup(sockets=[self.sock])
        self._serving = asyncio.ensure_future(self.server.main_loop())
        log.info("gateway listening", url=self.url, hub=self.hub_mode)

    async def _drain(self, service: Service) -> None:
        started = time.monotonic()
        budget = max(0.0, service.settings.drain_timeout_s - 1.0)  # keep a second to close cleanly
        inflight = len(self.state.generations)
        if inflight:
            log.info("draining: waiting for in-flight generations", inflight=inflight, deadline_s=budget)
        if not await self.state.wait_idle(budget):
            log.warning("drain deadline reached; aborting generations", inflight=len(self.state.generations))
            await self.state.abandon_all()
            await self.state.wait_idle(0.5)
        await self._close_http()
        log.info("gateway drained", drain_s=round(time.monotonic() - started, 3))

    async def _close_http(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        server.should_exit = True
        if self._serving is not None:
            await self._serving
        if server.started:
            await server.shutdown(sockets=[self.sock] if self.sock else None)

    async def _stop(self, _service: Service) -> None:
        await self._close_http()
        if self.state.hub is not None:
            await self.state.hub.stop()


__all__ = ["GatewayServer", "bind"]
