"""The cluster the live-migration tests run against: a real nats-server, a registry and CPU
gpu_worker processes serving one tiny generated model and a LoRA adapter, plus the pieces
both migration test files use (an in-process reference engine, a stream collector)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from service_procs import ServiceProcess, wait_ready
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.loading import engine_config
from shared.bus import Bus, BusSettings, Delivery
from shared.config import load_config
from shared.events import StreamError, TokenChunk
from shared.nats_server import NatsServer

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]
CONFIG = """
[cluster]
data_dir = "data"

[registry]
heartbeat_interval = "200ms"
dead_after = "1s"

[[models]]
name = "tiny"
path = "{model}"
max_context = {max_context}

[[adapters]]
name = "tiny-lora"
base = "tiny"
path = "{adapter}"
rank = 4
targets = ["q_proj", "v_proj"]
{workers}
[policies]
max_batch_size = 16
step_token_budget = {step_token_budget}
kv_block_tokens = 8
"""
WORKER = """
[[workers]]
id = "{id}"
device = "cpu"
memory = "64MiB"
models = ["tiny"]
adapters = ["tiny-lora"]
"""


@dataclass
class MigrationCluster:
    url: str
    config: Path
    procs: dict[str, ServiceProcess] = field(default_factory=dict)


@contextmanager
def migration_cluster(directory: Path, workers: tuple[str, ...], *, max_context: int, step_token_budget: int,
                      worker_env: Mapping[str, Mapping[str, str]] | None = None) -> Iterator[MigrationCluster]:
    """`worker_env`: extra environment for some workers (fault injection), by worker id."""
    model = make_model(directory / "tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    adapter = make_lora(directory / "tiny-lora", model, rank=4, targets=["q", "v"], seed=9)
    config = directory / "cluster.toml"
    config.write_text(CONFIG.format(model=model, adapter=adapter, max_context=max_context,
                                    step_token_budget=step_token_budget,
                                    workers="".join(WORKER.format(id=w) for w in workers)))
    nats = NatsServer(store_dir=directory / "nats").start()
    cluster = MigrationCluster(nats.url, config)
    try:
        cluster.procs["registry"] = ServiceProcess("registry", nats.url, config, f"registry-{directory.name}").start()
        for w in workers:
            proc = ServiceProcess("gpu_worker", nats.url, config, f"worker-{w}", "--worker-id", w, "--threads", "1")
            extra = dict((worker_env or {}).get(w, {}))
            os.environ.update(extra)  # the environment is read at Popen
            try:
                cluster.procs[w] = proc.start()
            finally:
                for key in extra:
                    os.environ.pop(key, None)

        async def ready() -> None:
            bus = await Bus.connect(BusSettings(url=nats.url), service="test")
            try:
                for proc in cluster.procs.values():
                    await wait_ready(bus, proc, timeout=120)
            finally:
                await bus.close()

        asyncio.run(ready())
        yield cluster
    finally:
        for proc in reversed(list(cluster.procs.values())):
            proc.stop()
        nats.stop()


def reference_engine(config: Path) -> LLMEngine:
    """The same model and adapter as the workers, in process: what an unmigrated run yields."""
    cfg = load_config(config)
    worker = cfg.worker("w0")
    engine = LLMEngine(engine_config(cfg, worker, cfg.model("tiny"), int(worker.memory), threads=1))
    engine.add_lora("tiny-lora", str(cfg.adapter("tiny-lora").path))
    return engine


class Stream:
    """A request's chunks as the bus delivers them."""

    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []
        self.errors: list[StreamError] = []
        self.done = asyncio.Event()

    async def on(self, msg: TokenChunk | StreamError, _ctx: Delivery) -> None:
        (self.chunks if isinstance(msg, TokenChunk) else self.errors).append(msg)  # type: ignore[arg-type]
        if msg.final:
            self.done.set()


__all__ = ["PROMPT", "MigrationCluster", "Stream", "migration_cluster", "reference_engine"]
