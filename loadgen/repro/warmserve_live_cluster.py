"""`tidal repro warmserve --live`: the local cluster of real processes, one per run (prewarm on or off).

nats-server, registry, gateway, dispatcher (scale from zero), planner (`autoscale`), predictor (short
windows) and 4 CPU gpu_workers. `[policies] prewarm` is the only setting that differs between the runs,
and workers read it (grace period, Prewarm), so each run starts a fresh cluster. Every process is in its
own process group with its log under `<root>/logs/`; `stop()` leaves none behind.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from loadgen.repro.live_services import LOCAL_CLUSTER_TOML, LiveServices

CONFIG = LOCAL_CLUSTER_TOML + """
[dispatcher]
queue_bound = 1024
scale_from_zero = true
stats_interval = "1s"

[planner]
interval = "500ms"
ctl_timeout = "30s"
autoscale = true
request_time = "{request_time_s}s"

[predictor]
window = "{window_s}s"
peak_slot = "1s"
lookback = {lookback}

[policies]
max_batch_size = {batch}
step_token_budget = 512
prewarm = {prewarm}
buddy_groups = false
migration = "off"

[observability]
log_level = "warning"
"""


@dataclass(frozen=True)
class WarmLiveClusterSpec:
    models: dict[str, Path]  # name -> checkpoint
    workers: dict[str, list[str]]  # worker id -> initial placement
    memory: str = "512MiB"
    grace_period_s: float = 20.0
    window_s: float = 5.0
    lookback: int = 2
    batch: int = 2
    request_time_s: float = 1.0

    def toml(self, prewarm: bool, data: Path, port: int) -> str:
        text = CONFIG.format(data=data, port=port, request_time_s=self.request_time_s, window_s=self.window_s, lookback=self.lookback,
                             batch=self.batch, prewarm=str(prewarm).lower())
        for name, path in self.models.items():
            text += f'\n[[models]]\nname = "{name}"\npath = "{path}"\ndtype = "float32"\nmax_context = 512\n'
        for worker, models in self.workers.items():
            text += (f'\n[[workers]]\nid = "{worker}"\ndevice = "cpu"\nmemory = "{self.memory}"\n'
                     f'models = {json.dumps(models)}\ngrace_period = "{self.grace_period_s}s"\n')
        return text


class WarmLiveCluster:
    SERVICES = ("gateway", "dispatcher", "planner", "predictor")

    def __init__(self, root: Path, spec: WarmLiveClusterSpec, port: int) -> None:
        self.root, self.spec, self.port = root, spec, port
        self.url = f"http://127.0.0.1:{port}"
        self.config = root / "cluster.toml"
        self.services = LiveServices(root, self.config, "warm-live",
                                     lambda service: "info" if service in ("planner", "gpu_worker") else "warning")

    @property
    def nats_url(self) -> str:
        return self.services.nats_url

    def start(self, prewarm: bool, timeout_s: float = 180.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.spec.toml(prewarm, self.root / "data", self.port))
        self.services.start_nats()
        self.services.launch("registry")
        for worker in self.spec.workers:
            self.services.launch(f"gpu_worker:{worker}", "--worker-id", worker)
        for name in self.SERVICES:
            self.services.launch(name)
        models = sorted({m for ms in self.spec.workers.values() for m in ms})
        self.services.warm_up(self.url, models, time.monotonic() + timeout_s, timeout_s=30.0)

    def stop(self) -> None:
        self.services.stop()


__all__ = ["WarmLiveCluster", "WarmLiveClusterSpec"]
