"""The fidelity check's live side: `BenchCluster` with N gpu_workers (one torch thread each,
as the profile was measured), ready once every worker publishes READY stats."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from shared.nats_server import NatsServer
from tidal.bench.bench_cluster import BenchCluster, _ready


class MultiWorkerCluster(BenchCluster):
    def __init__(self, root: Path, config: Path, worker_ids: list[str], threads: int = 1) -> None:
        super().__init__(root, config)
        self.worker_ids = worker_ids
        self.threads = threads

    def start(self, *, gateway_url: str, timeout_s: float = 180.0) -> None:
        self.nats = NatsServer(store_dir=self.root / "nats").start()
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIDAL_WORKER_THREADS": str(self.threads)}
        launches = [("registry", []), ("dispatcher", [])]
        launches += [(f"gpu_worker:{w}", ["--worker-id", w]) for w in self.worker_ids]
        launches.append(("gateway", []))
        for name, extra in launches:
            service = name.split(":")[0]
            argv = [sys.executable, "-m", f"services.{service}", "--nats", self.nats.url, "--config", str(self.config),
                    "--instance", f"fidelity-{name.replace(':', '-')}", "--metrics-port", "-1",
                    "--log-level", "warning", *extra]
            with open(logs / f"{name.replace(':', '-')}.log", "ab") as log:
                self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    start_new_session=True, env=env)
        deadline = time.monotonic() + timeout_s
        while not _ready(gateway_url):
            self._check(deadline)
            time.sleep(0.2)
        asyncio.run(self._workers_ready(deadline))

    def _check(self, deadline: float) -> None:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"cluster not serving ({'exited: ' + ', '.join(dead) if dead else 'timeout'}); "
                               f"logs in {self.root / 'logs'}")

    async def _workers_ready(self, deadline: float) -> None:
        from shared.bus import Bus, BusSettings, Delivery
        from shared.events import WorkerState, WorkerStats
        from shared.subjects import worker_stats

        assert self.nats is not None
        ready: set[str] = set()

        async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
            if msg.state is WorkerState.READY and msg.instances:
                ready.add(msg.worker_id)

        bus = await Bus.connect(BusSettings(url=self.nats.url), service="cli")
        try:
            await bus.subscribe(worker_stats(), WorkerStats, on_stats)
            while ready < set(self.worker_ids):
                self._check(deadline)
                await asyncio.sleep(0.1)
        finally:
            await bus.close()


__all__ = ["MultiWorkerCluster"]
