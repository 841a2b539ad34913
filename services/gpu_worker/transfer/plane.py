"""A worker's data plane: one UCX listener, links to peers opened on demand and reused.

    plane = DataPlane("worker-a", resolver=registry_address)   # resolver: peer id -> "host:port"
    await plane.start()                                         # publish plane.address in the registry
    link = await plane.link("worker-b")                         # connects once, then reused
    receipt = await link.send(kv_tensor, kind=TrafficClass.KV, key="kv:req-1:0-16")
    # on worker-b:  sink = plane.inbox.expect("kv:req-1:0-16", kv_blocks); await sink.wait()

ucxx keeps one UCX context and worker per process; a process runs one DataPlane. UCX's
transports are chosen with UCX_TLS (default here `tcp,self,sm`: runs on any host; set it to
include `cuda_copy,cuda_ipc,rc` on GPU nodes) before the first plane starts.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from shared.logging import get_logger

from .errors import TransferFailed
from .inbound import ChunkHook, InboundConnection
from .link import Link
from .policy import ChunkingConfig
from .sink import Inbox

log = get_logger(__name__)

Resolver = Callable[[str], Awaitable[str | None]]  # peer worker id -> "host:port" (or None: unknown)


@dataclass(frozen=True)
class DataPlaneConfig:
    host: str = "127.0.0.1"  # address to listen on and to publish
    port: int = 0  # 0: any free port
    ucx_tls: str | None = "tcp,self,sm"  # None: leave UCX_TLS as the environment has it
    connect_timeout_s: float = 10.0
    checksums: bool = True  # xxh3 per chunk, verified by the receiver; off only to measure what they cost
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)


def format_address(host: str, port: int) -> str:
    """The string published in `WorkerRecord.ucx_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"data-plane address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _ucxx() -> Any:
    import ucxx  # deferred: loading UCX takes ~1 s, and only workers need it

    return ucxx


def configure_ucx(tls: str | None) -> None:
    """Environment for UCX, before its first use in this process."""
    if tls is not None:
        os.environ.setdefault("UCX_TLS", tls)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


_bound_loop: asyncio.AbstractEventLoop | None = None
_planes_open = 0


def acquire_ucx(tls: str | None) -> Any:
    """The ucxx module, initialised for the running event loop; pair with `release_ucx()`.

    ucxx's defaults poll every pending request with `asyncio.sleep(0)`: many pending
    receives keep the loop (and a core) busy. Python futures completed by ucxx's notifier
    thread cost nothing while idle and were 2-5x faster here. That thread is bound to one
    event loop and keeps the interpreter from exiting, so UCX is reset when the last plane
    of the process closes, and initialised again by the next one (a new loop, a new test)."""
    global _bound_loop, _planes_open
    loop = asyncio.get_running_loop()
    configure_ucx(tls)  # before ucxx's import reads the environment
    ucxx = _ucxx()
    if _bound_loop is not loop:
        if _bound_loop is not None:
            _reset(ucxx)
        ucxx.init(
            progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", "thread"),
            enable_delayed_submission=os.environ.get("UCXPY_ENABLE_DELAYED_SUBMISSION", "1") != "0",
            enable_python_future=os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0",
        )
        _bound_loop = loop
    _planes_open += 1
    return ucxx


def release_ucx() -> None:
    global _planes_open
    _planes_open = max(0, _planes_open - 1)
    if _planes_open == 0 and _bound_loop is not None:
        _reset(_ucxx())


def _reset(ucxx: Any) -> None:
    global _bound_loop
    _bound_loop = None
    ucxx.stop_notifier_thread()  # first: whatever happens below, the process can exit
    try:
        ucxx.reset()
    except Exception as exc:  # noqa: BLE001 - something still holds an endpoint; UCX stays up
        log.warning("UCX not reset: endpoints still referenced", error=str(exc)[:500])


class DataPlane:
    def __init__(self, worker_id: str, *, config: DataPlaneConfig | None = None, resolver: Resolver | None = None,
                 chunk_hook: ChunkHook | None = None) -> None:
        self.worker_id = worker_id
        self.config = config or DataPlaneConfig()
        self.resolver = resolver
        self.chunk_hook = chunk_hook  # fault injection on received payloads (tests, benchmarks)
        self.inbox = Inbox()
        self._listener: Any = None
        self._links: dict[str, Link] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._inbound: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._ucx: Any = None

    def _runtime(self) -> Any:
        if self._ucx is None:
            self._ucx = acquire_ucx(self.config.ucx_tls)
        return self._ucx

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("the data plane is not started")
        return format_address(self.config.host, self._listener.port)

    async def start(self) -> "DataPlane":
        self._listener = self._runtime().create_listener(self._accept, port=self.config.port)
        log.info("data plane listening", worker=self.worker_id, address=self.address)
        return self

    async def _accept(self, endpoint: Any) -> None:
        conn = InboundConnection(endpoint, self.inbox, chunk_hook=self.chunk_hook)
        task = asyncio.current_task()
        if task is not None:
            self._inbound.add(task)
        try:
            await conn.run()
        finally:
            if task is not None:
                self._inbound.discard(task)

    async def link(self, peer: str, address: str | None = None) -> Link:
        """The link to `peer`, connecting on first use (address from the resolver unless given).

        Raises TransferFailed('unreachable') when no address is known or nothing answers."""
        if self._closed:
            raise TransferFailed("closed", "the data plane is shut down", peer=peer)
        existing = self._links.get(peer)
        if existing is not None and existing.alive:
            return existing
        lock = self._connecting.setdefault(peer, asyncio.Lock())
        async with lock:
            existing = self._links.get(peer)
            if existing is not None and existing.alive:
                return existing
            link = await self._connect(peer, address)
            self._links[peer] = link
            return link

    async def _connect(self, peer: str, address: str | None) -> Link:
        if address is None and self.resolver is not None:
            address = await self.resolver(peer)
        if not address:
            raise TransferFailed("unreachable", "no data-plane address is known for this worker", peer=peer)
        host, port = parse_address(address)
        chunking = self.config.chunking
        lanes = 2 if chunking.express_activations and not chunking.fifo else 1  # bulk (+ express: activations)
        opening = [asyncio.ensure_future(asyncio.wait_for(self._runtime().create_endpoint(host, port),
                                                          self.config.connect_timeout_s)) for _ in range(lanes)]
        results = await asyncio.gather(*opening, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for ep in results:
                if not isinstance(ep, BaseException):
                    ep.abort()
            # refused, timed out, UCX error: all mean unreachable
            raise TransferFailed("unreachable", f"cannot connect to {address}: {failed[0]!r}", peer=peer) from None
        link = Link(self.worker_id, peer, results[0], chunking, express_endpoint=results[1] if lanes == 2 else None,
                    checksums=self.config.checksums, on_dead=self._forget)
        return await link.start()

    def _forget(self, link: Link) -> None:
        if self._links.get(link.peer) is link:
            del self._links[link.peer]  # the next link() reconnects
        task = asyncio.ensure_future(link.close())  # release the broken endpoint
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        for task in list(self._inbound):
            task.cancel()
        await asyncio.gather(*self._inbound, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ucx is not None:
            self._ucx = None
            release_ucx()
