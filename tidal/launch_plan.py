"""What `tidal up` starts: one child per service (one gpu_worker per configured worker), with
its command line, log file and drain deadline — derived from the cluster config, no I/O."""
from __future__ import annotations

import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import ClusterConfig
from shared.subjects import SERVICES

# Start order: the registry first (the others announce themselves in it), then the rest.
START_ORDER: tuple[str, ...] = ("registry", "predictor", "planner", "dispatcher", "gpu_worker", "gateway")
DEFAULT_DRAIN_S = 10.0


@dataclass
class ChildSpec:
    name: str  # the service, e.g. "dispatcher"
    instance_base: str  # e.g. "dispatcher-vm-3f9a1c"; a restart appends "-r<N>"
    log_path: Path
    drain_timeout_s: float
    args: list[str] = field(default_factory=list)  # service options other than --instance
    worker_id: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # e.g. its NATS URL with its credentials (not in argv)

    @property
    def label(self) -> str:
        """How the launcher names it in messages and log files: the service, or gpu_worker-<id>."""
        return f"{self.name}-{self.worker_id}" if self.worker_id else self.name

    def instance(self, restarts: int) -> str:
        return self.instance_base if restarts == 0 else f"{self.instance_base}-r{restarts}"

    def argv(self, restarts: int) -> list[str]:
        return [sys.executable, "-m", f"services.{self.name}", "--instance", self.instance(restarts), *self.args]


def _host_token() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:16] or "host"


def plan_children(
    cfg: ClusterConfig, *, nats_url: str, config_path: str | None, run_id: str, logs_dir: Path,
    services: list[str] | None = None, workers: list[str] | None = None,
    role_url: Callable[[str], str] | None = None,
) -> list[ChildSpec]:
    """The children to start, in start order. `services`/`workers` pick a subset (multi-host).
    `role_url(service)`: each service's own NATS URL (with its credentials) instead of `nats_url` for all.
    Either way the URL goes in the child's environment ($TIDAL_NATS_URL), never on its command line:
    `ps` shows every user the arguments, a password among them."""
    wanted = list(services) if services else list(SERVICES)
    unknown = [s for s in wanted if s not in SERVICES]
    if unknown:
        raise ValueError(f"unknown service(s) {', '.join(unknown)}: expected some of {', '.join(SERVICES)}")
    worker_ids = [w.id for w in cfg.workers]
    if workers:
        missing = [w for w in workers if w not in worker_ids]
        if missing:
            raise ValueError(f"unknown worker(s) {', '.join(missing)}: the config has {', '.join(worker_ids) or 'none'}")
        worker_ids = [w for w in worker_ids if w in workers]
    obs = cfg.observability
    common = ["--log-level", obs.log_level, "--tracing", obs.tracing]

    def env(name: str) -> dict[str, str]:
        return {"TIDAL_NATS_URL": role_url(name) if role_url is not None else nats_url}

    if config_path:
        common += ["--config", config_path]
    host = _host_token()
    children: list[ChildSpec] = []
    for name in START_ORDER:
        if name not in wanted:
            continue
        drain = float(cfg.gateway.drain_timeout) if name == "gateway" else DEFAULT_DRAIN_S
        if name != "gpu_worker":
            port = obs.metrics_port(name)
            children.append(ChildSpec(
                name=name, instance_base=f"{name}-{host}-{run_id}", log_path=logs_dir / f"{name}.log",
                drain_timeout_s=drain, env=env(name),
                args=[*common, "--metrics-port", str(port), "--drain-timeout", str(drain)],
            ))
            continue
        for index, worker in enumerate(cfg.workers):
            if worker.id not in worker_ids:
                continue
            children.append(ChildSpec(
                name=name, instance_base=f"gpu_worker-{worker.id}-{run_id}"[:58],
                log_path=logs_dir / f"gpu_worker-{worker.id}.log", drain_timeout_s=drain, worker_id=worker.id,
                env=env(name),
                args=[*common, "--metrics-port", str(obs.metrics_port(name, index)), "--drain-timeout", str(drain),
                      "--worker-id", worker.id],
            ))
    return children
