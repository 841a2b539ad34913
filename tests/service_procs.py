"""Test helpers: run real service processes (`python -m services.<name>`) against a real NATS."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from shared.bus import Bus, BusSettings
from shared.nats_server import NatsServer, free_port
from shared.health import HealthReply
from tidal.health_probe import gather_health

ROOT = Path(__file__).resolve().parents[1]

# Fast liveness so tests are quick: heartbeats every 200 ms, dead after 1 s of silence. The
# start of the test configs (TOML), data under the config's folder.
FAST_LIVENESS = """
[cluster]
data_dir = "data"

[registry]
heartbeat_interval = "200ms"
dead_after = "1s"
"""

TINY_CONFIG = FAST_LIVENESS + """
[[workers]]
id = "w0"
device = "cpu"
memory = "64MiB"

[[workers]]
id = "w1"
device = "cpu"
memory = "128MiB"
"""


def write_config(directory: Path, text: str = TINY_CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "cluster.toml"
    if "[gateway]" not in text:  # never the default 8000: a developer's `make run` may hold it
        text += f"\n[gateway]\nport = {free_port()}\n"
    path.write_text(text)
    return path


class ServiceProcess:
    """One service process, its own process group, its log in a file."""

    def __init__(self, name: str, nats_url: str, config: Path, instance: str, *extra: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.instance = instance
        self.env = dict(env or {})  # on top of this process's environment (e.g. fault injection)
        self.argv = [sys.executable, "-m", f"services.{name}", "--nats", nats_url, "--config", str(config),
                     "--instance", instance, "--metrics-port", "-1", "--drain-timeout", "3", *extra]
        self.log_path = config.parent / f"{instance}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "ServiceProcess":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"})
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal the process group and wait; SIGKILL after `timeout`. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


async def wait_ready(bus: Bus, proc: ServiceProcess, timeout: float = 45.0) -> HealthReply:
    """Until `proc` answers its health subject with state ready (fails fast if it exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.proc is not None and proc.proc.poll() is None, f"{proc.instance} exited:\n{proc.log()[-3000:]}"
        replies = await gather_health(bus, proc.name, timeout=0.3, expect={proc.instance})
        reply = replies.get(proc.instance)
        if reply is not None and reply.state == "ready":
            return reply
        await asyncio.sleep(0.1)
    raise AssertionError(f"{proc.instance} not ready within {timeout}s:\n{proc.log()[-3000:]}")


class LocalCluster:
    """A nats-server and the service processes started against it (see `local_cluster`)."""

    def __init__(self, nats: NatsServer) -> None:
        self.nats = nats
        self.procs: list[ServiceProcess] = []

    @property
    def url(self) -> str:
        return self.nats.url

    def start(self, name: str, config: Path, instance: str, *extra: str,
              env: Mapping[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(name, self.url, config, instance, *extra, env=env).start()
        self.procs.append(proc)
        return proc

    def wait_ready(self, timeout: float) -> list[HealthReply]:
        """From synchronous code (a module fixture): until every process started so far is ready;
        their health replies, in start order."""
        async def ready() -> list[HealthReply]:
            bus = await Bus.connect(BusSettings(url=self.url), service="test")
            try:
                return [await wait_ready(bus, proc, timeout=timeout) for proc in self.procs]
            finally:
                await bus.close()

        return asyncio.run(ready())

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.nats.stop()


@contextmanager
def local_cluster(directory: Path) -> Iterator[LocalCluster]:
    """A nats-server (its store in `directory`) for the processes started on it; at exit they are
    stopped, the last started first, then the server."""
    cluster = LocalCluster(NatsServer(store_dir=directory / "nats").start())
    try:
        yield cluster
    finally:
        cluster.stop()


@contextmanager
def registry_and_worker(directory: Path, config: Path, *, timeout: float = 60.0) -> Iterator[str]:
    """A registry and one real gpu_worker `w0` (one thread) on `config`; yields the NATS url."""
    with local_cluster(directory) as services:
        services.start("registry", config, "registry-t")
        services.start("gpu_worker", config, "worker-w0", "--worker-id", "w0", "--threads", "1")
        services.wait_ready(timeout=timeout)
        yield services.url


async def eventually(check, timeout: float = 10.0, interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll the async `check()` until it returns a truthy value; returns it."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")
