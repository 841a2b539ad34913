"""A real dispatcher process (prefix-aware routing on, the default) on a real NATS: a `PrefixSummary` on
`tidal.v1.evt.worker.prefixes` saying w1 holds a prompt's leading blocks sends that prompt to w1 rather
than to the idle w0; a prompt w1 does not hold still goes by load; with `prefix_routing = false` the
same summary changes nothing. The two workers are this test's subscribers on their assign subjects
(their stats, heartbeats and summaries are published as a worker publishes them)."""
from __future__ import annotations

import time

import pytest
from dispatcher.dispatch_builders import heartbeat, instance, stats

from service_procs import ServiceProcess, eventually, wait_ready, write_config
from shared.bus import Bus, BusSettings, Delivery
from shared.events import (
    AssignAccepted, Assignment, PrefixSummary, SamplingParams, SubmitAccepted, SubmitReply, SubmitRequest,
)
from shared.prefix_hash import block_hashes, prefix_salt
from shared.subjects import dispatch_submit, worker_assign, worker_heartbeat, worker_prefixes, worker_stats

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[cluster]
data_dir = "data"

[registry]
dead_after = "30s"

[dispatcher]
prefix_routing = {routing}

[policies]
kv_block_tokens = 16

[[models]]
name = "m"
path = "/nowhere/m"
max_context = 512
"""
SYSTEM = list(range(1000, 1000 + 12 * 16))  # a 12-block shared prefix


@pytest.mark.parametrize("routing", [True, False])
async def test_a_request_goes_to_the_instance_holding_its_prefix(nats_url, tmp_path, routing: bool) -> None:
    config = write_config(tmp_path, CONFIG.format(routing="true" if routing else "false"))
    dispatcher = ServiceProcess("dispatcher", nats_url, config, "dispatcher-p1").start()
    bus = await Bus.connect(BusSettings(url=nats_url), service="gpu_worker")
    got: list[str] = []
    try:
        await wait_ready(bus, dispatcher)
        for worker in ("w0", "w1"):
            async def accept(msg: Assignment, _ctx: Delivery, worker: str = worker) -> AssignAccepted:
                got.append(worker)
                return AssignAccepted(request_id=msg.request_id, worker_id=worker, instance_id=msg.instance_id)

            await bus.subscribe(worker_assign(worker), Assignment, accept)
        # w0 idle (least load's pick), w1 with 4 blocks of KV in use
        for worker, iid, used in (("w0", "i0", 0), ("w1", "i1", 4)):
            await bus.publish(worker_heartbeat(), heartbeat(worker))
            await bus.publish(worker_stats(), stats(worker, instance(iid, used=used)))

        async def submit(rid: str, prompt: list[int]) -> SubmitReply:
            return await bus.request(dispatch_submit(), SubmitRequest(
                request_id=rid, model="m", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=8),
                arrival_ts=time.time()), SubmitReply, timeout=3.0)

        async def routable() -> bool:  # assigned, not queued (the stats may reach the dispatcher after a submit)
            reply = await submit(f"warm-{time.monotonic_ns()}", [1, 2, 3])
            return isinstance(reply, SubmitAccepted) and reply.worker_id is not None

        await eventually(routable, timeout=10.0, interval=0.1)

        async def delivered() -> bool:  # the submit's reply names the worker before the Assignment reaches it
            return bool(got)

        await eventually(delivered, timeout=10.0)
        assert set(got) == {"w0"}  # short prompts, nothing held: least load
        held = block_hashes(SYSTEM, 16, prefix_salt("m", None))
        await bus.publish(worker_prefixes(), PrefixSummary(
            worker_id="w1", instance_id="i1", model="m", seq=0, ts=time.time(), block_size=16,
            hashes=held[::-1], held_blocks=len(held)))
        # the summary and the submits share this connection: NATS delivers them to the dispatcher in order
        reply = await submit("shared-prefix", SYSTEM + [7, 8, 9])
        assert isinstance(reply, SubmitAccepted)
        assert reply.worker_id == ("w1" if routing else "w0")
        other = await submit("other-prefix", list(range(2000, 2000 + 12 * 16)) + [7])
        # held nowhere: by load, so away from the worker that just took the long prompt
        assert isinstance(other, SubmitAccepted) and other.worker_id != reply.worker_id
    finally:
        await bus.close()
        dispatcher.stop()
