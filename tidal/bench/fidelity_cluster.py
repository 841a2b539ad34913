"""The fidelity check's live side: `BenchCluster` with N gpu_workers (one torch thread each,
as the profile was measured), ready once every worker publishes READY stats."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tidal.bench.bench_cluster import BenchCluster, _ready, launch


class MultiWorkerCluster(BenchCluster):
    def __init__(self, root: Path, config: Path, worker_ids: list[str], threads: int = 1) -> None:
        super().__init__(root, config)
        self.worker_ids = worker_ids
        self.threads = threads

    def start(self, *, gateway_url: str, timeout_s: float = 180.0) -> None:
        logs = self.start_nats()
        launches = [("registry", []), ("dispatcher", [])]
        launches += [(f"gpu_worker:{w}", ["--worker-id", w]) for w in self.worker_ids]
        launches.append(("gateway", []))
        for name, extra in launches:
            self.procs[name] = launch(f"services.{name.split(':')[0]}", self.nats_url, self.config,
                                      f"fidelity-{name.replace(':', '-')}", logs / f"{name.replace(':', '-')}.log",
                                      *extra, env={"TIDAL_WORKER_THREADS": str(self.threads)})
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
