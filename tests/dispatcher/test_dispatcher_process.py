"""The dispatcher as a real process on a real NATS: typed errors for bad input, no registry needed
to answer, the registry's catalog picked up when it comes, a clean drain on SIGTERM."""
from __future__ import annotations

import asyncio
import time

import pytest

from service_procs import FAST_LIVENESS, ServiceProcess, eventually, wait_ready, write_config
from shared.bus import Bus, BusSettings, Delivery
from shared.events import (
    DispatchStats, ModelRecord, SamplingParams, SubmitRejected, SubmitReply, SubmitRequest, WorkerRecord,
)
from shared.registry_client import RegistryClient
from shared.subjects import dispatch_stats, dispatch_submit
from shared.wire import BAD_REQUEST, UNKNOWN_MESSAGE, RemoteError, encode

pytestmark = pytest.mark.timeout(120)

CONFIG = FAST_LIVENESS + """
[[models]]
name = "cfg-model"
path = "/nowhere/cfg-model"
max_context = 64
"""


def submit(rid: str, model: str, *, prompt: int = 4, max_tokens: int = 8) -> SubmitRequest:
    return SubmitRequest(request_id=rid, model=model, prompt_token_ids=list(range(1, prompt + 1)),
                         sampling=SamplingParams(max_tokens=max_tokens), arrival_ts=time.time())


async def ask(bus: Bus, msg: SubmitRequest) -> SubmitReply:
    return await bus.request(dispatch_submit(), msg, SubmitReply, timeout=3.0)


async def test_answers_without_a_registry_then_learns_the_catalog_when_it_comes(nats_url, tmp_path) -> None:
    config = write_config(tmp_path, CONFIG)
    dispatcher = ServiceProcess("dispatcher", nats_url, config, "dispatcher-t1").start()
    registry = ServiceProcess("registry", nats_url, config, "registry-t1")
    bus = await Bus.connect(BusSettings(url=nats_url), service="gateway")
    try:
        await wait_ready(bus, dispatcher)  # ready although no registry answers
        loads: list[DispatchStats] = []

        async def on_stats(msg: DispatchStats, _ctx: Delivery) -> None:
            loads.append(msg)

        await bus.subscribe(dispatch_stats(), DispatchStats, on_stats)
        # malformed messages get typed errors naming what is wrong; the process lives on
        reply = await bus.nc.request(dispatch_submit(), b"\xc1 not msgpack", timeout=3)
        assert reply.headers and reply.headers.get("tidal-error") == BAD_REQUEST
        with pytest.raises(RemoteError) as err:
            await bus.request(dispatch_submit(), WorkerRecord(worker_id="w", device="cpu", memory_capacity_bytes=1),
                              SubmitReply, timeout=3.0)
        assert err.value.code == UNKNOWN_MESSAGE
        raw = encode(submit("r-1", "cfg-model")).replace(b"cfg-model", b"bad model")  # same length, bad pattern
        reply = await bus.nc.request(dispatch_submit(), raw, timeout=3)
        assert reply.headers and reply.headers.get("tidal-error") == BAD_REQUEST and b"model" in reply.data
        # typed refusals: unknown model, the config's model without any instance, too long a request
        unknown = await ask(bus, submit("r-2", "nope"))
        assert isinstance(unknown, SubmitRejected) and unknown.reason == "model_not_found"
        idle = await ask(bus, submit("r-3", "cfg-model"))
        assert isinstance(idle, SubmitRejected) and idle.reason == "no_capacity" and idle.retry_after_s
        long = await ask(bus, submit("r-4", "cfg-model", prompt=60, max_tokens=5))
        assert isinstance(long, SubmitRejected) and long.reason == "context_length_exceeded"
        # the interval's per-model load: the refusals of the known model, nothing about unknown names
        async def reported() -> bool:
            return any(m.model == "cfg-model" for s in loads for m in s.models)

        await eventually(reported, timeout=5.0)
        (load,) = [m for s in loads for m in s.models if m.model == "cfg-model"]
        assert (load.arrivals, load.rejected, load.admitted) == (2, 2, 0)
        assert not any(m.model == "nope" for s in loads for m in s.models)
        assert all(s.dispatcher_id == "dispatcher-t1" for s in loads)
        # a registry started later: a model it catalogues becomes known (no_capacity, not model_not_found)
        registry.start()
        await wait_ready(bus, registry)
        catalog = RegistryClient(bus, timeout=3.0)
        await catalog.create(ModelRecord(name="late-model", path="/nowhere/late", num_layers=2, max_context=32))

        async def known() -> bool:
            reply = await ask(bus, submit(f"r-{time.monotonic_ns()}", "late-model"))
            return isinstance(reply, SubmitRejected) and reply.reason == "no_capacity"

        await eventually(known, timeout=15.0, interval=0.2)
        too_long = await ask(bus, submit("r-5", "late-model", prompt=30, max_tokens=3))
        assert isinstance(too_long, SubmitRejected) and too_long.reason == "context_length_exceeded"
        assert dispatcher.proc is not None and dispatcher.proc.poll() is None
        assert await asyncio.to_thread(dispatcher.stop) == 0  # SIGTERM: drains and exits 0
    finally:
        await bus.close()
        dispatcher.stop()
        registry.stop()
