"""`tidal repro mell --live`: the local cluster — real processes, one config per phase.

nats-server, registry, gateway, the gpu_workers, the dispatcher and the planner; a phase sets
what differs between the runs compared (`[planner] enabled`, `[dispatcher] routing_policy`).
Every process is in its own process group, logs under `<root>/logs/`; `stop()` leaves none
behind. Workers run one torch thread each (`TIDAL_WORKER_THREADS=1`, as on a shared CPU).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.nats_server import NatsServer

CONFIG = """\
[cluster]
data_dir = "{data}"

[gateway]
host = "127.0.0.1"
port = {port}
drain_timeout = "3s"

[dispatcher]
queue_bound = 1024
scale_from_zero = false
routing_policy = "{routing}"

[planner]
enabled = {planner}
interval = "{interval_ms}ms"
kv_high_watermark = {watermark}
ctl_timeout = "20s"

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.nats: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.config = root / "cluster.toml"

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def start(self, phase: Phase, timeout_s: float = 180.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.spec.toml(phase, self.root / "data", self.port))
        self.nats = NatsServer(store_dir=self.root / "nats").start()
        self._launch("registry")
        for worker in self.spec.workers:
            self._launch(f"gpu_worker:{worker}", "--worker-id", worker)
        self._launch("gateway")
        self._launch("dispatcher")
        self._launch("planner")
        deadline = time.monotonic() + timeout_s
        asyncio.run(self._workers_ready(deadline))
        self._warm_up(deadline)

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "registry"]:
            self._signal(name, signal.SIGTERM)
        for name in [n for n in self.procs if n != "registry"]:
            self._wait(name)
        if "registry" in self.procs:
            self._signal("registry", signal.SIGTERM)
            self._wait("registry")
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    # --- processes --------------------------------------------------------------------------
    def _launch(self, name: str, *extra: str) -> None:
        service = name.split(":")[0]
        tag = name.replace(":", "-")
        argv = [sys.executable, "-m", f"services.{service}", "--nats", self.nats_url, "--config", str(self.config),
                "--instance", f"mell-live-{tag}", "--metrics-port", "-1", "--log-level", "warning", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIDAL_WORKER_THREADS": "1"}
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        with open(self.root / "logs" / f"{tag}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, env=env)

    def _signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def _wait(self, name: str) -> None:
        try:
            self.procs[name].wait(15)
        except subprocess.TimeoutExpired:
            self._signal(name, signal.SIGKILL)
            self.procs[name].wait()

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.root / "logs" / f"{name.replace(':', '-')}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def _check(self, deadline: float, what: str) -> None:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}:\n{self.log_tail(n)}" for n in dead)
            raise RuntimeError(f"live cluster: {'exited: ' + ', '.join(dead) if dead else 'timed out'} ({what}); "
                               f"logs in {self.root / 'logs'}\n{tails}")

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
                self._check(deadline, f"workers ready: {sorted(ready)}")
                await asyncio.sleep(0.1)
        finally:
            await bus.close()

    def _warm_up(self, deadline: float) -> None:
        """Until the gateway is ready and each model completes one token through it."""
        for name in ["/ready", *self.spec.models]:
            while (status := self._try(name)) != 200:
                self._check(deadline, f"warm-up {name}: HTTP {status}")
                time.sleep(0.3)

    def _try(self, name: str) -> int:
        if name == "/ready":
            request = urllib.request.Request(self.url + "/ready")
        else:
            body = json.dumps({"model": name, "prompt": [20, 21, 22], "max_tokens": 1}).encode()
            request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0


__all__ = ["LiveCluster", "LiveClusterSpec", "PHASES", "Phase", "free_port"]
