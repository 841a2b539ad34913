"""A gateway with what it needs and nothing more, as real processes: nats-server, the registry,
optionally the dispatcher, and `python -m services.gateway` on a free port.

The registry is seeded with a model whose directory holds only a tokenizer (the gateway
never loads weights) and a LoRA adapter of it; without a gpu_worker nothing generates
tokens, which is what the error-path tests want. `stop()` leaves no process behind.
"""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import httpx

from service_procs import ServiceProcess
from shared.bus import Bus, BusSettings
from shared.events.registry import AdapterRecord, ModelRecord
from shared.nats_server import NatsServer, free_port
from shared.registry_client import RegistryClient

MODEL = "tok-model"
ADAPTER = "tok-lora"
MAX_CONTEXT = 128
T = TypeVar("T")

BASE_TOML = """
[cluster]
data_dir = "{data}"

[gateway]
host = "127.0.0.1"
port = {port}
drain_timeout = "3s"
{gateway_extra}

[gateway.limits]
max_body_bytes = "16KiB"
max_prompt_tokens = 100
max_tokens = 64
max_n = 4
max_stop_sequences = 2
request_timeout = "60s"
{limits_extra}

[registry]
heartbeat_interval = "200ms"
dead_after = "1s"
"""


class GatewayStack:
    def __init__(self, root: Path, tokenizer_dir: Path, *, dispatcher: bool, gateway_extra: str = "",
                 limits_extra: str = "") -> None:
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self.with_dispatcher = dispatcher
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = root / "cluster.toml"
        self.config.write_text(BASE_TOML.format(data=root / "data", port=self.port, gateway_extra=gateway_extra,
                                               limits_extra=limits_extra))
        self.nats: NatsServer | None = None
        self.procs: dict[str, ServiceProcess] = {}

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    @property
    def gateway(self) -> ServiceProcess:
        return self.procs["gateway"]

    def start(self) -> "GatewayStack":
        try:
            self.nats = NatsServer(store_dir=self.root / "nats").start()
            self.procs["registry"] = ServiceProcess("registry", self.nats.url, self.config, "registry-gw").start()
            self.run(self._seed())
            if self.with_dispatcher:
                self.procs["dispatcher"] = ServiceProcess("dispatcher", self.nats.url, self.config,
                                                          "dispatcher-gw").start()
            self.procs["gateway"] = ServiceProcess("gateway", self.nats.url, self.config, "gateway-gw").start()
            self.wait_http(lambda r: r.status_code in (200, 401), "/v1/models")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("gateway", "dispatcher", "registry"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop(signal.SIGTERM, timeout=10.0)
        if self.nats is not None:
            self.nats.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{p.log()[-3000:]}" for name, p in self.procs.items())

    # --- helpers ----------------------------------------------------------------------------
    @staticmethod
    def run(coro: Awaitable[T]) -> T:
        return asyncio.run(coro)  # type: ignore[arg-type]

    async def registry(self, work: Callable[[RegistryClient], Awaitable[T]]) -> T:
        bus = await Bus.connect(BusSettings(url=self.nats_url), service="cli")
        try:
            return await work(RegistryClient(bus, timeout=2.0))
        finally:
            await bus.close()

    async def _seed(self) -> None:
        model = ModelRecord(name=MODEL, path=str(self.tokenizer_dir), num_layers=1, max_context=MAX_CONTEXT)
        adapter = AdapterRecord(name=ADAPTER, base=MODEL, path=str(self.root / "no-such-adapter"), rank=4,
                                targets=["q_proj"])

        async def write(registry: RegistryClient) -> None:
            deadline = time.monotonic() + 30
            while True:
                try:
                    await registry.modify("models", MODEL, lambda _r: model)
                    await registry.modify("adapters", ADAPTER, lambda _r: adapter)
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)

        await self.registry(write)

    def wait_http(self, ok: Callable[[httpx.Response], bool], path: str, timeout: float = 45.0,
                  headers: dict[str, str] | None = None) -> httpx.Response:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            proc = self.gateway.proc
            assert proc is not None and proc.poll() is None, f"gateway exited:\n{self.logs()}"
            try:
                last = httpx.get(self.url + path, headers=headers, timeout=5)
                if ok(last):
                    return last  # type: ignore[no-any-return]
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.1)
        raise AssertionError(f"{path}: not as expected within {timeout}s (last: {last!r})\n{self.logs()}")


__all__ = ["ADAPTER", "GatewayStack", "MAX_CONTEXT", "MODEL"]
