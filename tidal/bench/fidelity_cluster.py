"""The fidelity check's live side: `BenchCluster` with N gpu_workers (one torch thread each,
as the profile was measured), ready once every worker publishes READY stats; `StatsWatch`
follows the workers' stats during a run (preemptions, KV blocks) as the planner would."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from loadgen.runner.bench_cluster import BenchCluster, gateway_ready, launch

T = TypeVar("T")


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
        while not gateway_ready(gateway_url):
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


class HostShare:
    """CPU the host spent outside this benchmark (this process and its descendants: the cluster)
    between two marks: what other processes took from the live run, which the simulator cannot
    know. Linux /proc/stat."""

    def __init__(self) -> None:
        self._mark = self._now()

    def _now(self) -> tuple[float, float, float]:
        import psutil

        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / hz  # all but idle and iowait
        ours = 0.0
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:  # the cluster's processes and their helpers
            try:
                t = proc.cpu_times()
                ours += t.user + t.system
            except psutil.Error:
                pass  # gone since listed
        return time.monotonic(), busy, ours

    def others(self) -> float:
        """Cores used by other processes since the last call (or since made); marks now."""
        now = self._now()
        wall = now[0] - self._mark[0]
        if wall < 1.0:  # /proc/stat counts in ticks of 10 ms: too short to tell
            self._mark = now
            return float("nan")
        cores = max(0.0, (now[1] - self._mark[1]) - (now[2] - self._mark[2])) / wall
        self._mark = now
        return cores


@dataclass
class WorkerKv:
    """One worker's engine as its stats told it: the latest counters and the KV peak seen."""

    preemptions: int = 0  # cumulative, from the latest stats
    preemptions_at_start: int = 0  # from the first stats seen (the run's own are the difference)
    kv_blocks_total: int = 0  # in the engine's unit: one layer's blocks (InstanceStats)
    kv_blocks_used: int = 0
    kv_peak: float = 0.0  # highest used/total seen


@dataclass
class StatsWatch:
    """Latest stats per worker, read from the bus while `run` is awaited (the live engine's
    recompute preemptions reach the outside only through `InstanceStats.preemptions`)."""

    workers: dict[str, WorkerKv] = field(default_factory=dict)
    messages: int = 0

    def observe(self, worker_id: str, preemptions: int, total: int, used: int) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerKv(preemptions_at_start=preemptions)
        w.preemptions, w.kv_blocks_total, w.kv_blocks_used = preemptions, total, used
        if total:
            w.kv_peak = max(w.kv_peak, used / total)
        self.messages += 1

    @property
    def preemptions(self) -> int:
        """Preemptions since the watch began (one instance per worker)."""
        return sum(w.preemptions - w.preemptions_at_start for w in self.workers.values())

    async def run(self, nats_url: str, workers: int, start: "Callable[[], Awaitable[T]]",
                  settle_s: float = 0.8, timeout_s: float = 10.0) -> T:
        """Subscribe, wait for stats from `workers` workers (the counters at the start), await
        `start()`, then watch `settle_s` more (a few stats intervals) so that the last stats count
        every preemption of the run; returns what `start()` returned."""
        from shared.bus import Bus, BusSettings, Delivery
        from shared.events import WorkerStats
        from shared.subjects import worker_stats

        async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
            for inst in msg.instances:
                self.observe(msg.worker_id, inst.preemptions, inst.kv_blocks_total, inst.kv_blocks_used)

        bus = await Bus.connect(BusSettings(url=nats_url), service="cli")
        try:
            await bus.subscribe(worker_stats(), WorkerStats, on_stats)
            deadline = time.monotonic() + timeout_s
            while len(self.workers) < workers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stats from {len(self.workers)} of {workers} workers in {timeout_s:.0f} s")
                await asyncio.sleep(0.05)
            result = await start()
            await asyncio.sleep(settle_s)
            return result
        finally:
            await bus.close()


__all__ = ["HostShare", "MultiWorkerCluster", "StatsWatch", "WorkerKv"]
