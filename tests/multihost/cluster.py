"""Tidal on three "hosts" (tests/multihost/netns.py) as docs/operations.md "Several hosts" runs it:
`tidal nats-config` writes the NATS config and one credentials file per role; h1 runs nats-server and
`tidal up --nats URL --nats-credentials DIR --services registry,dispatcher,gateway`; h2 and h3 each
`tidal up ... --services gpu_worker --workers wN` with `TIDAL_DATAPLANE_HOST` set to the host's address
(KV moves across hosts over UCX). Every host has its own data_dir; the gateway listens on 0.0.0.0.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from e2e.assets import LLAMA, TinyAssets
from e2e.cluster import ClusterSpec, cluster_toml
from multihost.netns import Hosts
from shared.nats_credentials import read_credentials
from shared.nats_server import nats_server_binary
from shared.run_state import read_state
from tidal.process_control import recorded_alive

ROOT = Path(__file__).resolve().parents[2]
NATS_PORT = 4222
GATEWAY_PORT = 8000
DATAPLANE_PORT = 7400  # fixed, so a firewall can open it (0 would pick any port)
WORKERS = {2: "w2", 3: "w3"}  # host -> the worker it runs
SPEC = ClusterSpec(workers={w: [LLAMA] for w in WORKERS.values()}, max_batch=4, queue_bound=32, max_redispatches=3)


class MultiHostCluster:
    def __init__(self, root: Path, hosts: Hosts, assets: TinyAssets) -> None:
        self.root, self.hosts, self.assets = root, hosts, assets
        self.nats_url = f"nats://{hosts.address(1)}:{NATS_PORT}"
        self.creds = root / "nats" / "credentials"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def gateway_url(self) -> str:
        return f"http://{self.hosts.address(1)}:{GATEWAY_PORT}"

    def role_url(self, role: str) -> str:
        return read_credentials(self.creds / f"{role}.toml").url_with()

    def data_dir(self, host: int) -> Path:
        return self.root / f"h{host}" / "data"

    def _config(self, host: int) -> Path:
        text = cluster_toml(SPEC, self.assets, self.data_dir(host), GATEWAY_PORT)
        text = text.replace('[gateway]\nhost = "127.0.0.1"', '[gateway]\nhost = "0.0.0.0"')
        path = self.root / f"h{host}" / "cluster.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def _env(self, host: int) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "TIDAL_WORKER_THREADS": "1",
               "XDG_STATE_HOME": str(self.root / f"h{host}" / "user-state")}
        env.pop("TIDAL_STATE", None)
        if host in WORKERS:
            env |= {"TIDAL_DATAPLANE_HOST": self.hosts.address(host), "TIDAL_DATAPLANE_PORT": str(DATAPLANE_PORT)}
        return env

    def start(self, timeout_s: float = 240.0) -> "MultiHostCluster":
        done = subprocess.run([sys.executable, "-m", "tidal", "nats-config", "--out", str(self.root / "nats"),
                               "--url", self.nats_url, "--listen", f"0.0.0.0:{NATS_PORT}"],
                              capture_output=True, text=True, timeout=60, env=self._env(1))
        assert done.returncode == 0, done.stdout + done.stderr
        self.procs["nats"] = self.hosts.popen(1, [nats_server_binary(), "-c", str(self.root / "nats" / "nats.conf")],
                                              log=self.root / "nats.log", env=self._env(1))
        self._wait_port(self.hosts.address(1), NATS_PORT, 30)
        up = [sys.executable, "-m", "tidal", "up", "--nats", self.nats_url, "--nats-credentials", str(self.creds),
              "--wait", "180"]
        plan = {1: ["--services", "registry,dispatcher,gateway"]}
        plan |= {host: ["--services", "gpu_worker", "--workers", worker] for host, worker in WORKERS.items()}
        for host, extra in plan.items():
            self.procs[f"h{host}"] = self.hosts.popen(host, [*up, "--config", str(self._config(host)), *extra],
                                                      log=self.root / f"h{host}-up.log", env=self._env(host))
            if host == 1:
                self._wait_ready(1, timeout_s)  # the registry first: the workers announce themselves in it
        for host in WORKERS:
            self._wait_ready(host, timeout_s)
        return self

    def _wait_port(self, host: str, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"nothing listens on {host}:{port}: {self.log('nats')[-2000:]}")

    def _wait_ready(self, host: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[f"h{host}"]
            assert proc.poll() is None, f"tidal up on h{host} exited:\n{self.log(f'h{host}')[-4000:]}"
            state = read_state(self.data_dir(host))
            if state is not None and state.ready:
                return
            time.sleep(0.2)
        raise AssertionError(f"tidal up on h{host} not ready in {timeout_s}s:\n{self.log(f'h{host}')[-4000:]}")

    def log(self, name: str) -> str:
        path = self.root / ("nats.log" if name == "nats" else f"{name}-up.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def service_logs(self) -> dict[str, str]:
        return {f"h{host}/{log.name}": log.read_text(errors="replace")
                for host in (1, *WORKERS) for log in (self.data_dir(host) / "logs").glob("*.log")}

    def stop(self) -> None:
        for name in ("h2", "h3", "h1", "nats"):  # `tidal up` stops its children in order on SIGTERM
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for host in (1, *WORKERS):  # a launcher that did not stop in time leaves its children: end them
            state = read_state(self.data_dir(host))
            for child in state.processes if state is not None else []:
                if recorded_alive(child):
                    os.killpg(child.pgid, signal.SIGKILL)
