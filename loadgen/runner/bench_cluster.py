"""A throwaway serving cluster for benchmarks: nats-server, registry, dispatcher, one gpu_worker,
gateway — real processes, each in its own process group, logs under the run directory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from shared.nats_server import NatsServer

SERVICES = ("registry", "dispatcher", "gpu_worker", "gateway")


class BenchCluster:
    def __init__(self, root: Path, config: Path, *, worker_id: str = "bench-0", worker_args: list[str] | None = None) -> None:
        self.root = root
        self.config = config
        self.worker_id = worker_id
        self.worker_args = worker_args or []
        self.nats: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, *, gateway_url: str, timeout_s: float = 120.0) -> None:
        logs = self.start_nats()
        for name in SERVICES:
            extra = ["--worker-id", self.worker_id, *self.worker_args] if name == "gpu_worker" else []
            self.procs[name] = launch(f"services.{name}", self.nats_url, self.config, f"bench-{name}",
                                      logs / f"{name}.log", *extra)
        self.wait_serving(gateway_url, time.monotonic() + timeout_s)

    def start_nats(self) -> Path:
        """Start the nats-server; returns the folder the processes' logs go to."""
        self.nats = NatsServer(store_dir=self.root / "nats").start()
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def wait_serving(self, gateway_url: str, deadline: float) -> None:
        """Until the gateway answers /ready; RuntimeError with the logs' tails if a process exits
        or `deadline` (time.monotonic()) passes first."""
        while not gateway_ready(gateway_url):
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.log_tail(n)}" for n in (dead or list(self.procs)))
                raise RuntimeError(f"cluster not serving ({'exited: ' + ', '.join(dead) if dead else 'timeout'}):\n{tails}")
            time.sleep(0.2)

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds so far of each process (nats included)."""
        import psutil

        pids = {name: proc.pid for name, proc in self.procs.items()}
        if self.nats is not None and self.nats.proc is not None:
            pids["nats"] = self.nats.proc.pid
        out = {}
        for name, pid in pids.items():
            try:
                times = psutil.Process(pid).cpu_times()
                out[name] = times.user + times.system
            except psutil.Error:
                out[name] = 0.0
        return out

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def stop(self) -> None:
        terminate(list(self.procs.values()))
        if self.nats is not None:
            self.nats.stop()


def launch(module: str, nats_url: str, config: Path, instance: str, log_path: Path, *extra: str,
           env: Mapping[str, str] | None = None, log_level: str = "warning") -> subprocess.Popen[bytes]:
    """`python -m <module>` on the cluster in a process group of its own (a stop reaches its
    children), its log (from `log_level` up) appended to `log_path`; `env` on top of this process's."""
    argv = [sys.executable, "-m", module, "--nats", nats_url, "--config", str(config), "--instance", instance,
            "--metrics-port", "-1", "--log-level", log_level, *extra]
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def terminate(procs: list[subprocess.Popen[bytes]], timeout_s: float = 15.0) -> None:
    """SIGTERM every process group, then wait for each; SIGKILL one still there after `timeout_s`."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def gateway_ready(url: str) -> bool:
    """Whether the gateway at `url` answers /ready with 200."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
