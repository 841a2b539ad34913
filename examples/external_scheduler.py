"""An external scheduler in ~80 lines: watch the cluster on NATS, move requests with ctl commands.

Run the cluster with `[planner] enabled = false` (the built-in planner then decides nothing), then:

    python examples/external_scheduler.py --credentials <data_dir>/credentials/scheduler.toml [--duration 30] [--dry-run]

(`tidal up` writes that file: the `scheduler` NATS user alone and the server's URL; with a NATS of your
own, the `scheduler.toml` of `tidal nats-config`. `--nats URL` instead joins a NATS without users.)

It prints every plan event (`tidal.v1.evt.plan.*`, e.g. from a planner that is enabled) and, every
second, each worker's KV use from `tidal.v1.evt.worker.stats`. Its policy is deliberately naive: when
two or more workers hold requests, it moves the requests of the least-loaded one to the most-loaded
one (`MigrateOut`, token mode, on the source's `tidal.v1.worker.<id>.ctl`), which empties a worker.
With --dry-run it only prints the moves it would make.
"""
from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from shared.bus import Bus, BusSettings, Delivery
from shared.events.ctl import CtlDone, CtlReply, MigrateOut
from shared.events.plan import PlanDecided, PlanEvent
from shared.events.worker import WorkerStats
from shared.nats_credentials import read_credentials
from shared.subjects import CATALOG, worker_ctl, worker_stats


async def main(nats: str, duration: float, dry_run: bool) -> None:
    bus = await Bus.connect(BusSettings(url=nats), service="scheduler")
    latest: dict[str, WorkerStats] = {}

    async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
        latest[msg.worker_id] = msg

    async def on_plan(msg: PlanEvent, _ctx: Delivery) -> None:
        what = msg.plan.actions[0] if isinstance(msg, PlanDecided) and msg.plan.actions else None
        plan_id = msg.plan.plan_id if isinstance(msg, PlanDecided) else msg.plan_id
        print(f"plan {type(msg).__name__} {plan_id} {type(what).__name__ if what else ''}", flush=True)

    await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on_plan)
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            for wid, s in sorted(latest.items()):
                used = sum(i.kv_blocks_used for i in s.instances)
                total = sum(i.kv_blocks_total for i in s.instances)
                print(f"worker {wid} {s.state} kv {used}/{total} requests "
                      f"{sum(len(i.requests) for i in s.instances)}", flush=True)
            await consolidate(bus, latest, dry_run)
    finally:
        await bus.close()


async def consolidate(bus: Bus, latest: dict[str, WorkerStats], dry_run: bool) -> None:
    busy = {wid: s for wid, s in latest.items() if any(i.requests for i in s.instances)}
    if len(busy) < 2:
        return
    load = {wid: sum(len(i.requests) for i in s.instances) for wid, s in busy.items()}
    source, destination = min(load, key=load.__getitem__), max(load, key=load.__getitem__)
    target = busy[destination].instances[0].instance_id
    for inst in busy[source].instances:
        for req in inst.requests:
            move = MigrateOut(idempotency_key=uuid.uuid4().hex, request_id=req.request_id, destination=destination,
                              destination_instance=target, mode="tokens")
            if dry_run:
                print(f"would move {req.request_id} {source} -> {destination}", flush=True)
                continue
            reply = await bus.request(worker_ctl(source), move, CtlReply, timeout=30.0)
            outcome = "moved" if isinstance(reply, CtlDone) else f"refused ({reply.code}: {reply.message})"
            print(f"{req.request_id} {source} -> {destination}: {outcome}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--credentials", help="the scheduler's NATS credentials file (its url and user)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds to run")
    parser.add_argument("--dry-run", action="store_true", help="print the moves, send nothing")
    args = parser.parse_args()
    url = read_credentials(args.credentials).url_with() if args.credentials else args.nats
    asyncio.run(main(url, args.duration, args.dry_run))
