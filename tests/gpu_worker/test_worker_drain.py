"""SIGTERM drains a real gpu_worker: new assignments are refused with `draining`, admitted
requests run to their end, the stats say `draining`, and the process exits 0."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from service_procs import ServiceProcess, wait_ready
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignRejected, AssignReply, TokenChunk, WorkerState, WorkerStats
from shared.subjects import worker_assign, worker_stats
from worker_harness import assignment, make_assets, watch


async def test_sigterm_refuses_new_work_and_finishes_admitted_requests(tmp_path: Path, nats_url: str) -> None:
    config = make_assets(tmp_path)
    # No registry: the worker serves without one (it keeps retrying its catalog writes).
    worker = ServiceProcess("gpu_worker", nats_url, config, "worker-drain", "--worker-id", "w0", "--threads", "1",
                            "--drain-timeout", "20").start()
    bus = await Bus.connect(BusSettings(url=nats_url), service="test")
    try:
        await wait_ready(bus, worker, timeout=60)
        states: list[WorkerState] = []

        async def on_stats(msg: WorkerStats, _ctx: object) -> None:
            states.append(msg.state)

        await bus.subscribe(worker_stats(), WorkerStats, on_stats)
        admitted = {}
        for i in range(3):
            rid = f"drain-{i}"
            admitted[rid] = await watch(bus, rid)
            reply = await bus.request(worker_assign("w0"), assignment(rid, [1, 20 + i, 30, 40], max_tokens=150), AssignReply)
            assert isinstance(reply, AssignAccepted)
        os.killpg(worker.pid, signal.SIGTERM)
        refused = None
        for i in range(200):  # until the worker has seen the signal; what it accepts before counts as admitted
            rid = f"late-{i}"
            stream = await watch(bus, rid)
            reply = await bus.request(worker_assign("w0"), assignment(rid, [1, 5, 6], max_tokens=150), AssignReply)
            if isinstance(reply, AssignRejected):
                refused = reply
                break
            admitted[rid] = stream
            await asyncio.sleep(0.005)
        assert refused is not None and refused.reason == "draining" and refused.retry_after_s
        for stream in admitted.values():
            await stream.wait(timeout=30)
            final = stream.final
            assert isinstance(final, TokenChunk) and final.finish_reason == "length"
            assert len(stream.tokens) == 150 and [c.seq for c in stream.chunks] == list(range(len(stream.chunks)))
        assert WorkerState.DRAINING in states
        code = await asyncio.to_thread(worker.proc.wait, 30)  # type: ignore[union-attr]
        assert code == 0, worker.log()[-3000:]
    finally:
        await bus.close()
        worker.stop()
