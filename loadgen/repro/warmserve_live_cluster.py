"""`tidal repro warmserve --live`: the local cluster of real processes, one per run (prewarm on or off).

nats-server, registry, gateway, dispatcher (scale from zero), planner (`autoscale`), predictor (short
windows) and 4 CPU gpu_workers. `[policies] prewarm` is the only setting that differs between the runs,
and workers read it (grace period, Prewarm), so each run starts a fresh cluster. Every process is in its
own process group with its log under `<root>/logs/`; `stop()` leaves none behind.
"""
from __future__ import annotations

import json
import os
import signal
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
scale_from_zero = true
stats_interval = "1s"

[planner]
interval = "500ms"
ctl_timeout = "30s"
autoscale = true
scale_down_after = "{scale_down_after_s}s"
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
    scale_down_after_s: float = 3.0

    def toml(self, prewarm: bool, data: Path, port: int) -> str:
        text = CONFIG.format(data=data, port=port, scale_down_after_s=self.scale_down_after_s,
                             request_time_s=self.request_time_s, window_s=self.window_s, lookback=self.lookback,
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
        self.nats: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.config = root / "cluster.toml"

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def start(self, prewarm: bool, timeout_s: float = 180.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.spec.toml(prewarm, self.root / "data", self.port))
        self.nats = NatsServer(store_dir=self.root / "nats").start()
        self._launch("registry")
        for worker in self.spec.workers:
            self._launch(f"gpu_worker:{worker}", "--worker-id", worker)
        for name in self.SERVICES:
            self._launch(name)
        deadline = time.monotonic() + timeout_s
        for name in ["/ready", *sorted({m for ms in self.spec.workers.values() for m in ms})]:
            while (status := self._try(name)) != 200:
                self._check(deadline, f"warm-up {name}: HTTP {status}")
                time.sleep(0.3)

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "registry"]:
            self._signal(name, signal.SIGTERM)
        for name in [n for n in self.procs if n != "registry"]:
            self._wait(name)
        if "registry" in self.procs:
            self._signal("registry", signal.SIGTERM)
            self._wait("registry")
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def _launch(self, name: str, *extra: str) -> None:
        service, tag = name.split(":")[0], name.replace(":", "-")
        argv = [sys.executable, "-m", f"services.{service}", "--nats", self.nats_url, "--config", str(self.config),
                "--instance", f"warm-live-{tag}", "--metrics-port", "-1", "--log-level",
                "info" if service in ("planner", "gpu_worker") else "warning", *extra]
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

    def _check(self, deadline: float, what: str) -> None:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"warmserve live cluster: {'exited: ' + ', '.join(dead) if dead else 'timed out'} "
                               f"({what}); logs in {self.root / 'logs'}")

    def _try(self, name: str) -> int:
        if name == "/ready":
            request = urllib.request.Request(self.url + "/ready")
        else:
            body = json.dumps({"model": name, "prompt": [20, 21, 22], "max_tokens": 1}).encode()
            request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                resp.read()
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0


__all__ = ["WarmLiveCluster", "WarmLiveClusterSpec"]
