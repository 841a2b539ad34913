"""The cluster the live-migration tests run against: a real nats-server, a registry and CPU
gpu_worker processes serving one tiny generated model and a LoRA adapter, plus the pieces
both migration test files use (an in-process reference engine, a stream collector)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from service_procs import FAST_LIVENESS, ServiceProcess, local_cluster
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.loading import engine_config
from shared.bus import Delivery
from shared.config import load_config
from shared.events import StreamError, TokenChunk

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]
CONFIG = FAST_LIVENESS + """
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
device = "{device}"
memory = "64MiB"
models = ["tiny"]
adapters = ["tiny-lora"]
min_step_time = "{min_step_time}"
"""
# The tiny model steps in ~0.2 ms on this CPU (~1 ms when these tests were written): a 200-token request
# would end within the ctl round trips a test makes while it runs. Every step lasts at least this long.
MIN_STEP_TIME = "2ms"


@dataclass
class MigrationCluster:
    url: str
    config: Path
    procs: dict[str, ServiceProcess] = field(default_factory=dict)


@contextmanager
def migration_cluster(directory: Path, workers: tuple[str, ...], *, max_context: int, step_token_budget: int,
                      worker_env: Mapping[str, Mapping[str, str]] | None = None,
                      device: str = "cpu", dead_after: str = "1s",
                      services: tuple[str, ...] = (), max_position: int = 2048,
                      min_step_time: str = MIN_STEP_TIME) -> Iterator[MigrationCluster]:
    """`worker_env`: extra environment for some workers (fault injection), by worker id; `device`:
    every worker's (tests/gpu run these workers on CUDA); `dead_after`: the registry's; `services`:
    more services to run (e.g. the dispatcher), each one process named after itself; `max_position`:
    the generated model's position limit (max_context cannot exceed it); `min_step_time`: the workers'
    floor on a step's duration."""
    model = make_model(directory / "tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3,
                       max_position=max_position)
    adapter = make_lora(directory / "tiny-lora", model, rank=4, targets=["q", "v"], seed=9)
    config = directory / "cluster.toml"
    text = CONFIG.replace('dead_after = "1s"', f'dead_after = "{dead_after}"')
    config.write_text(text.format(model=model, adapter=adapter, max_context=max_context,
                                  step_token_budget=step_token_budget,
                                  workers="".join(WORKER.format(id=w, device=device, min_step_time=min_step_time) for w in workers)))
    with local_cluster(directory) as local:
        cluster = MigrationCluster(local.url, config)
        cluster.procs["registry"] = local.start("registry", config, f"registry-{directory.name}")
        for name in services:
            cluster.procs[name] = local.start(name, config, f"{name}-{directory.name}")
        for w in workers:
            cluster.procs[w] = local.start("gpu_worker", config, f"worker-{w}", "--worker-id", w, "--threads", "1",
                                           env=(worker_env or {}).get(w))
        local.wait_ready(timeout=120)
        yield cluster


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
