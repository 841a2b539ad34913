"""`tidal repro mell --live`: the local cluster — real processes, one config per phase.

nats-server, registry, gateway, the gpu_workers, the dispatcher and the planner; a phase sets
what differs between the runs compared (`[planner] enabled`, `[dispatcher] routing_policy`).
Every process is in its own process group, logs under `<root>/logs/`; `stop()` leaves none
behind. Workers run one torch thread each (`TIDAL_WORKER_THREADS=1`, as on a shared CPU).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

from loadgen.repro.live_services import LOCAL_CLUSTER_TOML, LiveServices
from shared.nats_server import free_port

CONFIG = LOCAL_CLUSTER_TOML + """
[dispatcher]
queue_bound = 1024
scale_from_zero = false
routing_policy = "{routing}"

[planner]
enabled = {planner}
interval = "{interval_ms}ms"
kv_high_watermark = {watermark}
ctl_timeout = "20s"
packer = "mell"

[policies]
max_batch_size = {batch}
step_token_budget = 512
kv_block_tokens = {block}
migration = "{migration}"
prewarm = false
buddy_groups = false

[observability]
log_level = "warning"
"""


@dataclass(frozen=True)
class Phase:
    name: str  # "mell" or "no-planner"
    planner: bool
    routing: str  # the dispatcher's routing policy


PHASES = {"no-planner": Phase("no-planner", planner=False, routing="least_load"),
          "mell": Phase("mell", planner=True, routing="mell")}


@dataclass(frozen=True)
class LiveClusterSpec:
    models: dict[str, Path]  # name -> checkpoint
    workers: dict[str, list[str]]  # worker id -> the models it serves
    memory: str = "4MiB"  # each worker's pool: tight, so that KV packing matters
    interval_s: float = 0.5
    watermark: float = 0.9
    migration: str = "auto"
    max_batch: int = 16
    block_tokens: int = 16
    max_context: int = 2048

    def toml(self, phase: Phase, data: Path, port: int) -> str:
        text = CONFIG.format(data=data, port=port, routing=phase.routing, planner=str(phase.planner).lower(),
                             interval_ms=round(self.interval_s * 1000), watermark=self.watermark, batch=self.max_batch,
                             block=self.block_tokens, migration=self.migration)
        for name, path in self.models.items():
            text += (f'\n[[models]]\nname = "{name}"\npath = "{path}"\ndtype = "float32"\n'
                     f'max_context = {self.max_context}\n')
        for worker, models in self.workers.items():
            text += (f'\n[[workers]]\nid = "{worker}"\ndevice = "cpu"\nmemory = "{self.memory}"\n'
                     f'models = {json.dumps(models)}\nstream_interval = "20ms"\n')
        return text


class LiveCluster:
    def __init__(self, root: Path, spec: LiveClusterSpec, port: int) -> None:
        self.root = root
        self.spec = spec
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.config = root / "cluster.toml"
        self.services = LiveServices(root, self.config, "mell-live")

    @property
    def nats_url(self) -> str:
        return self.services.nats_url

    def start(self, phase: Phase, timeout_s: float = 180.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.spec.toml(phase, self.root / "data", self.port))
        self.services.start_nats()
        self.services.launch("registry")
        for worker in self.spec.workers:
            self.services.launch(f"gpu_worker:{worker}", "--worker-id", worker)
        for name in ("gateway", "dispatcher", "planner"):
            self.services.launch(name)
        deadline = time.monotonic() + timeout_s
        asyncio.run(self._workers_ready(deadline))
        self.services.warm_up(self.url, list(self.spec.models), deadline)

    def stop(self) -> None:
        self.services.stop()

    # --- readiness --------------------------------------------------------------------------
    async def _workers_ready(self, deadline: float) -> None:
        from shared.bus import Bus, BusSettings, Delivery
        from shared.events import WorkerState, WorkerStats
        from shared.subjects import worker_stats

        ready: set[str] = set()

        async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
            want = set(self.spec.workers.get(msg.worker_id, []))
            if msg.state is WorkerState.READY and {i.model for i in msg.instances} >= want:
                ready.add(msg.worker_id)

        bus = await Bus.connect(BusSettings(url=self.nats_url), service="cli")
        try:
            await bus.subscribe(worker_stats(), WorkerStats, on_stats)
            while ready < set(self.spec.workers):
                self.services.check(deadline, f"workers ready: {sorted(ready)}")
                await asyncio.sleep(0.1)
        finally:
            await bus.close()


__all__ = ["LiveCluster", "LiveClusterSpec", "PHASES", "Phase", "free_port"]
