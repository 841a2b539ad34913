"""A whole serving cluster as real processes for the end-to-end suite.

nats-server, registry, dispatcher, gateway and one gpu_worker per `[[workers]]` entry, from
a small temporary config pointing at the tiny checkpoints (`assets.py`). Fast liveness
(heartbeats every 200 ms, dead after 1 s) so a killed worker is noticed quickly. `start()`
returns once every process answers health as ready, the gateway's /ready is 200 and every
model (and adapter) has served one token through the gateway. `stop()` leaves no process.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from service_procs import ROOT, ServiceProcess
from shared.bus import Bus, BusSettings
from shared.events import WorkerState, WorkerStats
from shared.nats_server import NatsServer
from shared.nats_users import OPERATOR, NatsUsers
from shared.subjects import worker_stats
from tidal.health_probe import gather_health

from e2e.assets import BLOCK_TOKENS, LORA, MAX_CONTEXT, STEP_TOKEN_BUDGET, TinyAssets


@dataclass
class ClusterSpec:
    """What to run: worker id -> the models it serves (every adapter of a served model is loaded)."""

    workers: dict[str, list[str]]
    queue_bound: int = 64
    max_batch: int = 8
    max_redispatches: int = 2
    resident_adapters: dict[str, list[str]] = field(default_factory=dict)
    gateway: bool = True  # False: clients speak NATS (SubmitRequest) to the dispatcher directly
    dispatchers: int = 1  # more than one: a queue group, each owning the requests it admitted
    worker_memory: str = "192MiB"  # each worker's pool (a real model needs more than the tiny ones)
    metrics: bool = False  # every process serves /metrics on a free port (its HealthReply says which)
    control_plane: bool = False  # also the planner and the predictor
    migration: str = "auto"  # [policies] migration
    extra_toml: str = ""  # appended to the config (e.g. a [planner] section)
    scale_from_zero: bool = False  # [dispatcher] scale_from_zero (requests for a model with no instance wait)
    routing_policy: str = "least_load"  # [dispatcher] routing_policy ("mell": follow the planner's placement hints)
    policies_toml: str = ""  # more [policies] keys (e.g. 'buddy_groups = false')
    worker_toml: str = ""  # more keys of every [[workers]] entry (e.g. 'grace_period = "120s"')
    nats_users: bool = False  # per-role NATS users, as `tidal up` gives its embedded server (tools: the operator)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_toml(spec: ClusterSpec, assets: TinyAssets, data_dir: Path, port: int) -> str:
    lines = [
        f'[cluster]\ndata_dir = "{data_dir}"\n',
        f'[gateway]\nhost = "127.0.0.1"\nport = {port}\ndrain_timeout = "3s"\n',
        f'[dispatcher]\nqueue_bound = {spec.queue_bound}\nmax_redispatches = {spec.max_redispatches}\n'
        f'scale_from_zero = {str(spec.scale_from_zero).lower()}\nrouting_policy = "{spec.routing_policy}"\n',
        '[registry]\nheartbeat_interval = "200ms"\ndead_after = "1s"\n',
        f'[policies]\nmax_batch_size = {spec.max_batch}\nstep_token_budget = {STEP_TOKEN_BUDGET}\n'
        f'kv_block_tokens = {BLOCK_TOKENS}\nmigration = "{spec.migration}"\n{spec.policies_toml}\n',
    ]
    for name, path in assets.models.items():
        lines.append(f'[[models]]\nname = "{name}"\npath = "{path}"\nmax_context = {MAX_CONTEXT}\n')
    for name, (base, path) in assets.adapters.items():
        lines.append(f'[[adapters]]\nname = "{name}"\nbase = "{base}"\npath = "{path}"\nrank = 4\n'
                     'targets = ["q_proj", "v_proj"]\n')
    for worker, models in spec.workers.items():
        resident = spec.resident_adapters.get(worker, [])
        lines.append(f'[[workers]]\nid = "{worker}"\ndevice = "cpu"\nmemory = "{spec.worker_memory}"\n'
                     f'models = {models!r}\nadapters = {resident!r}\n'.replace("'", '"') + spec.worker_toml)
    lines.append(spec.extra_toml)
    return "\n".join(lines)


class WorkerProcess(ServiceProcess):
    """A gpu_worker with one torch thread (the suite shares two cores among all processes)."""

    def start(self) -> "WorkerProcess":
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIDAL_WORKER_THREADS": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        return self


class E2ECluster:
    def __init__(self, root: Path, spec: ClusterSpec, assets: TinyAssets) -> None:
        self.root = root
        self.spec = spec
        self.assets = assets
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.nats: NatsServer | None = None
        self.procs: dict[str, ServiceProcess] = {}
        self.config: Path = root / "cluster.toml"

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url_for(OPERATOR)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "E2ECluster":
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(cluster_toml(self.spec, self.assets, self.root / "data", self.port))
        users = NatsUsers.generate() if self.spec.nats_users else None
        self.nats = NatsServer(store_dir=self.root / "nats", users=users).start()
        url = self.nats.url_for
        m = ("--metrics-port", "0") if self.spec.metrics else ()  # the last --metrics-port wins
        self.procs["registry"] = ServiceProcess("registry", url("registry"), self.config, "registry-e2e", *m).start()
        for i in range(self.spec.dispatchers):
            name = "dispatcher" if i == 0 else f"dispatcher-{i}"
            self.procs[name] = ServiceProcess("dispatcher", url("dispatcher"), self.config, f"{name}-e2e", *m).start()
        for worker in self.spec.workers:
            self.procs[worker] = WorkerProcess("gpu_worker", url("gpu_worker"), self.config, f"gpu_worker-{worker}-e2e",
                                               "--worker-id", worker, *m).start()
        if self.spec.gateway:
            self.procs["gateway"] = ServiceProcess("gateway", url("gateway"), self.config, "gateway-e2e", *m).start()
        if self.spec.control_plane:
            for name in ("planner", "predictor"):
                self.procs[name] = ServiceProcess(name, url(name), self.config, f"{name}-e2e", *m).start()
        try:
            asyncio.run(self._wait_healthy(timeout))
            if self.spec.gateway:
                self._warm_up(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every service (SIGKILL after its deadline), the registry last, then NATS."""
        services = [p for name, p in self.procs.items() if name != "registry"]
        for proc in services:  # all at once: each drains in parallel
            if proc.proc is not None and proc.proc.poll() is None:
                try:
                    os.killpg(proc.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in services:
            if proc.proc is not None:
                try:
                    proc.proc.wait(10.0)
                except subprocess.TimeoutExpired:
                    proc.stop(signal.SIGKILL)
        if "registry" in self.procs:
            self.procs["registry"].stop(timeout=10.0)
        if self.nats is not None:
            self.nats.stop()

    def kill(self, name: str) -> None:
        """kill -9 a process (its process group)."""
        proc = self.procs[name]
        assert proc.proc is not None
        os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(10)

    def alive(self, name: str) -> bool:
        proc = self.procs[name].proc
        return proc is not None and proc.poll() is None

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {name} ---\n{p.log()[-tail:]}" for name, p in self.procs.items())

    # --- readiness --------------------------------------------------------------------------
    async def _wait_healthy(self, timeout: float) -> None:
        bus = await Bus.connect(BusSettings(url=self.nats_url), service="cli")
        try:
            deadline = time.monotonic() + timeout
            waiting = {p.instance: p for p in self.procs.values()}
            while waiting:
                for instance, proc in list(waiting.items()):
                    assert proc.proc is not None and proc.proc.poll() is None, (
                        f"{instance} exited during start-up:\n{proc.log()[-4000:]}")
                assert time.monotonic() < deadline, f"not ready within {timeout}s: {sorted(waiting)}\n{self.logs()}"
                for service in {p.name for p in waiting.values()}:
                    expect = {i for i, p in waiting.items() if p.name == service}
                    replies = await gather_health(bus, service, timeout=0.3, expect=expect)
                    for instance, reply in replies.items():
                        if reply.state == "ready":
                            waiting.pop(instance, None)
                await asyncio.sleep(0.1)
            await self._wait_workers_ready(bus, deadline)
        finally:
            await bus.close()

    async def _wait_workers_ready(self, bus: Bus, deadline: float) -> None:
        """Until every worker has published stats as ready with all its instances."""
        ready: set[str] = set()
        want = {w: set(models) for w, models in self.spec.workers.items()}

        async def on_stats(msg: WorkerStats, _ctx: object) -> None:
            if msg.state is WorkerState.READY and {i.model for i in msg.instances} >= want.get(msg.worker_id, set()):
                ready.add(msg.worker_id)

        sub = await bus.subscribe(worker_stats(), WorkerStats, on_stats)
        try:
            while ready < set(want):
                assert time.monotonic() < deadline, f"workers not ready: {sorted(set(want) - ready)}\n{self.logs()}"
                await asyncio.sleep(0.05)
        finally:
            await sub.unsubscribe()

    def _warm_up(self, timeout: float) -> None:
        """Until the gateway is ready and each served model (and adapter) completes one request."""
        deadline = time.monotonic() + timeout
        served = {m for models in self.spec.workers.values() for m in models}
        names = sorted(served) + sorted(a for a, (base, _p) in self.assets.adapters.items() if base in served)
        for name in ["/ready", *names]:
            while True:
                status, body = self._try(name)
                if status == 200:
                    break
                assert time.monotonic() < deadline, f"{name}: still {status} {body[:300]!r}\n{self.logs()}"
                time.sleep(0.2)

    def _try(self, name: str) -> tuple[int, str]:
        if name == "/ready":
            request = urllib.request.Request(self.base_url + "/ready")
        else:
            body = f'{{"model": "{name}", "prompt": "warm up", "max_tokens": 1}}'.encode()
            request = urllib.request.Request(self.base_url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except OSError as exc:
            return 0, repr(exc)

    # --- clients ----------------------------------------------------------------------------
    def openai(self, **kw: object):  # type: ignore[no-untyped-def]
        import openai

        options: dict[str, object] = {"max_retries": 0, "timeout": 60.0, **kw}
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", **options)  # type: ignore[arg-type]

    def async_openai(self, **kw: object):  # type: ignore[no-untyped-def]
        import openai

        options: dict[str, object] = {"max_retries": 0, "timeout": 60.0, **kw}
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", **options)  # type: ignore[arg-type]


__all__ = ["ClusterSpec", "E2ECluster", "LORA", "free_port"]
