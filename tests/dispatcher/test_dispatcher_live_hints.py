"""A real dispatcher process with `routing_policy = "mell"` on a real NATS: placement hints published on
`tidal.v1.evt.planner.placement` send a request to the hinted worker instead of the least-loaded one.
The two workers are this test's subscribers on their assign subjects (their stats and heartbeats are
published as a worker publishes them)."""
from __future__ import annotations

import time

import msgspec
import pytest
from dispatcher.dispatch_builders import heartbeat, instance, stats

from service_procs import ServiceProcess, eventually, wait_ready, write_config
from shared.bus import Bus, BusSettings, Delivery
from shared.events import (
    AssignAccepted, Assignment, PlacementEntry, PlacementHints, SamplingParams, SubmitAccepted, SubmitReply,
    SubmitRequest,
)
from shared.subjects import dispatch_submit, planner_placement, worker_assign, worker_heartbeat, worker_stats

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[cluster]
data_dir = "data"

[registry]
dead_after = "30s"

[dispatcher]
routing_policy = "mell"

[[models]]
name = "m"
path = "/nowhere/m"
max_context = 256
"""
BLOCK_BYTES = 16 * 1000
C = 64 * BLOCK_BYTES


def hints(worker: str) -> PlacementHints:
    cuts = [0, C // 8, C // 4, C // 3, C // 2, C]
    entries = [PlacementEntry(request_class=n, lower_bytes=lo, upper_bytes=hi, worker_id=worker, room_bytes=C)
               for n, lo, hi in zip(("tiny", "T", "S", "M", "L"), cuts, cuts[1:])]
    now = time.time()
    return PlacementHints(model="m", ts=now, capacity_bytes=C, entries=entries, valid_until=now + 60.0)


async def test_the_dispatcher_routes_by_the_planners_hint(nats_url, tmp_path) -> None:
    dispatcher = ServiceProcess("dispatcher", nats_url, write_config(tmp_path, CONFIG), "dispatcher-h1").start()
    bus = await Bus.connect(BusSettings(url=nats_url), service="gateway")
    got: list[str] = []
    try:
        await wait_ready(bus, dispatcher)
        for worker in ("w0", "w1"):
            async def accept(msg: Assignment, _ctx: Delivery, worker: str = worker) -> AssignAccepted:
                got.append(worker)
                return AssignAccepted(request_id=msg.request_id, worker_id=worker, instance_id=msg.instance_id)

            await bus.subscribe(worker_assign(worker), Assignment, accept)
        # w0 idle (least load's pick), w1 busy; both report their KV bytes per block
        for worker, iid, used, running in (("w0", "i0", 0, 0), ("w1", "i1", 8, 1)):
            await bus.publish(worker_heartbeat(), heartbeat(worker))
            inst = msgspec.structs.replace(instance(iid, used=used, running=running), kv_block_bytes=BLOCK_BYTES)
            await bus.publish(worker_stats(), stats(worker, inst))

        async def submit(rid: str) -> SubmitReply:
            return await bus.request(dispatch_submit(), SubmitRequest(
                request_id=rid, model="m", prompt_token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=8),
                arrival_ts=time.time()), SubmitReply, timeout=3.0)

        async def routable() -> bool:
            return isinstance(await submit(f"warm-{time.monotonic_ns()}"), SubmitAccepted)

        async def assigned() -> bool:
            return bool(got)

        await eventually(routable, timeout=10.0, interval=0.1)
        await eventually(assigned, timeout=5.0)
        assert got[-1] == "w0"  # no hints yet: least load
        await bus.publish(planner_placement(), hints("w1"))  # then, on the same connection, the submit
        reply = await submit("hinted")
        assert isinstance(reply, SubmitAccepted) and reply.worker_id == "w1"
    finally:
        await bus.close()
        dispatcher.stop()
