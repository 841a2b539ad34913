"""The processes of a live repro cluster: nats-server and the services, one process group each.

`LiveServices` starts them with one config (`python -m services.<name> --nats … --config …`),
logs each to `<root>/logs/<name>.log`, and `stop()` leaves none behind: every service but the
registry first (SIGTERM, then SIGKILL after 15 s), then the registry, then nats. Workers run
one torch thread each (`TIDAL_WORKER_THREADS=1`, as on a shared CPU). `completion_status`
asks the gateway for one token of a model (or `/ready`): the warm-up the clusters share.
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from shared.nats_server import NatsServer
from loadgen.runner.bench_cluster import launch, terminate

# the sections every live cluster's config starts with (the rest of each config is its own)
LOCAL_CLUSTER_TOML = """\
[cluster]
data_dir = "{data}"

[gateway]
host = "127.0.0.1"
port = {port}
drain_timeout = "3s"
"""


class LiveServices:
    def __init__(self, root: Path, config: Path, prefix: str,
                 log_level: Callable[[str], str] = lambda _service: "warning") -> None:
        self.root, self.config, self.prefix, self.log_level = root, config, prefix, log_level
        self.nats: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def start_nats(self) -> None:
        self.nats = NatsServer(store_dir=self.root / "nats").start()

    def launch(self, name: str, *extra: str) -> None:
        """`name` is a service, or `service:tag` for several of one kind (e.g. `gpu_worker:w0`)."""
        service, tag = name.split(":")[0], name.replace(":", "-")
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.procs[name] = launch(f"services.{service}", self.nats_url, self.config, f"{self.prefix}-{tag}",
                                  self.root / "logs" / f"{tag}.log", *extra, env={"TIDAL_WORKER_THREADS": "1"},
                                  log_level=self.log_level(service))

    def stop(self) -> None:
        terminate([p for n, p in self.procs.items() if n != "registry"])
        terminate([p for n, p in self.procs.items() if n == "registry"])  # last: the others deregister
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.root / "logs" / f"{name.replace(':', '-')}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def check(self, deadline: float, what: str) -> None:
        """Raise, with the dead processes' log tails, if one exited or `deadline` passed."""
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}:\n{self.log_tail(n)}" for n in dead)
            raise RuntimeError(f"{self.prefix} cluster: {'exited: ' + ', '.join(dead) if dead else 'timed out'} "
                               f"({what}); logs in {self.root / 'logs'}\n{tails}")

    def warm_up(self, url: str, targets: list[str], deadline: float, timeout_s: float = 10.0) -> None:
        """Until the gateway is ready (`/ready`) and each model completes one token through it."""
        for name in ["/ready", *targets]:
            while (status := completion_status(url, name, timeout_s)) != 200:
                self.check(deadline, f"warm-up {name}: HTTP {status}")
                time.sleep(0.3)


def completion_status(url: str, name: str, timeout_s: float = 10.0) -> int:
    """HTTP status of `GET /ready` (name "/ready") or of a one-token completion of model `name`; 0 if unreachable."""
    if name == "/ready":
        request = urllib.request.Request(url + "/ready")
    else:
        body = json.dumps({"model": name, "prompt": [20, 21, 22], "max_tokens": 1}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


__all__ = ["LOCAL_CLUSTER_TOML", "LiveServices", "completion_status"]
