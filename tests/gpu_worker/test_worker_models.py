"""Instances that come and go on a real gpu_worker process (real NATS and registry): LoadModel from
the checkpoint then serve; EvictModel drains, keeps the weights warm (kind prewarm) through the grace
period, then frees them; LoadModel onto warm bytes opens no checkpoint file (it is moved away); a
prewarmed first layer serves while the rest loads; typed refusals and idempotency.

The worker starts with NO model (its config's `models` is only the initial placement). The tests run
in order on one worker process."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from service_procs import ServiceProcess, eventually, wait_ready
from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams as EngineParams
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignRejected, AssignReply, Bucket, InstanceRecord, TokenChunk, WorkerStats
from shared.events.common import LayerRange
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, EvictModel, LoadModel, Prewarm
from shared.nats_server import NatsServer
from shared.registry_client import RegistryClient
from shared.subjects import worker_assign, worker_ctl, worker_stats
from worker_harness import assignment, watch

CONFIG = """
[registry]
heartbeat_interval = "200ms"
dead_after = "1s"

[[models]]
name = "one"
path = "{one}"
max_context = 512

[[models]]
name = "two"
path = "{two}"
max_context = 512

[[models]]
name = "big"
path = "{big}"

[[workers]]
id = "w0"
device = "cpu"
memory = "16MiB"
models = []
stream_interval = "20ms"
min_step_time = "2ms"  # (the tiny model steps in ~0.2 ms: a 200-token request would end before an evict lands)
grace_period = "{grace}"

[policies]
max_batch_size = 8
step_token_budget = 256
kv_block_tokens = 8
"""
PROMPT = [1, 40, 41, 42, 43, 44, 45]
MAX_TOKENS = 12


@dataclass
class Setup:
    url: str
    models: dict[str, Path]
    worker: ServiceProcess


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("models-ctl")
    dims = dict(layers=3, hidden=64, heads=4, kv_heads=2, vocab=512)
    models = {"one": make_model(root / "one", arch="llama", seed=3, **dims),
              "two": make_model(root / "two", arch="qwen2", seed=5, **dims)}
    big = root / "big"  # its config.json alone: far larger than the pool (no weights are ever read)
    big.mkdir()
    cfg = json.loads((models["one"] / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096, "intermediate_size": 14336,
                                                 "num_hidden_layers": 32}))
    config = root / "cluster.toml"
    config.write_text(CONFIG.format(one=models["one"], two=models["two"], big=big, grace="600s"))
    nats = NatsServer(store_dir=root / "nats").start()
    procs = [ServiceProcess("registry", nats.url, config, "registry-m").start(),
             ServiceProcess("gpu_worker", nats.url, config, "worker-m", "--worker-id", "w0", "--threads", "1",
                            "--stats-interval", "0.1").start()]
    try:
        yield Setup(nats.url, models, procs[1])
    finally:
        for proc in reversed(procs):
            proc.stop()
        nats.stop()


@pytest.fixture
async def bus(setup: Setup):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=setup.url), service="test")
    await wait_ready(bus, setup.worker, timeout=60)
    yield bus
    await bus.close()


def expected(model_dir: Path) -> list[int]:
    engine = LLMEngine(EngineConfig(str(model_dir), pool_bytes=16 << 20, block_size=8, workspace_bytes=1 << 16))
    [result] = engine.generate([PROMPT], EngineParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return result.token_ids


async def ctl(bus: Bus, command: object) -> CtlReply:
    return await bus.request(worker_ctl("w0"), command, CtlReply, timeout=30.0)


async def latest_stats(bus: Bus, check) -> WorkerStats:  # type: ignore[no-untyped-def]
    seen: list[WorkerStats] = []

    async def on(msg: WorkerStats, _ctx: object) -> None:
        seen.append(msg)

    sub = await bus.subscribe(worker_stats(), WorkerStats, on)
    try:
        async def ok() -> WorkerStats | None:
            return next((m for m in reversed(seen) if check(m)), None)
        return await eventually(ok, timeout=30)
    finally:
        await sub.unsubscribe()


async def serve(bus: Bus, model: str, rid: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    stream = await watch(bus, rid)
    a = msgspec.structs.replace(assignment(rid, PROMPT, max_tokens=max_tokens), model=model, instance_id=f"w0-{model}")
    reply = await bus.request(worker_assign("w0"), a, AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    await stream.wait(timeout=60)
    assert isinstance(stream.final, TokenChunk) and stream.final.finish_reason == "length"
    return stream.tokens


async def test_load_model_from_the_checkpoint_then_serve(bus: Bus, setup: Setup) -> None:
    idle = await latest_stats(bus, lambda m: m.state == "ready")
    assert idle.instances == [] and idle.pool.capacity_bytes == 16 << 20  # ready with no instance
    done = await ctl(bus, LoadModel(idempotency_key="load-one", model="one", instance_id="w0-one"))
    assert isinstance(done, CtlDone) and "from the checkpoint" in done.detail and done.pool is not None
    assert done.pool.weights_bytes > 0
    again = await ctl(bus, LoadModel(idempotency_key="load-one", model="one", instance_id="w0-one"))
    assert isinstance(again, CtlDone) and again.replayed  # the same key: applied once
    assert await serve(bus, "one", "m-1") == expected(setup.models["one"])
    registry = RegistryClient(bus, timeout=3.0)
    entry = await registry.get(Bucket.INSTANCES, "w0-one")
    assert entry is not None and isinstance(entry.record, InstanceRecord) and entry.record.state == "ready"


async def test_refusals(bus: Bus) -> None:
    unknown = await ctl(bus, LoadModel(idempotency_key="r-1", model="nope", instance_id="w0-nope"))
    assert isinstance(unknown, CtlRefused) and unknown.code == "not_found" and "'nope'" in unknown.message
    big = await ctl(bus, LoadModel(idempotency_key="r-2", model="big", instance_id="w0-big"))
    assert isinstance(big, CtlRefused) and big.code == "insufficient_memory"
    assert f"holds {16 << 20} B" in big.message and " B;" in big.message  # names the bytes
    reused = await ctl(bus, EvictModel(idempotency_key="r-1", model="one"))
    assert isinstance(reused, CtlRefused) and reused.code == "conflict"
    layers = await ctl(bus, Prewarm(idempotency_key="r-3", model="two", layers=LayerRange(start=1, end=2)))
    assert isinstance(layers, CtlRefused) and layers.code == "invalid"
    nothing = await ctl(bus, EvictModel(idempotency_key="r-4", model="two"))
    assert isinstance(nothing, CtlRefused) and nothing.code == "not_found"
    # proactive prewarming caps only a grace-period (draining) instance's KV (WarmServe Eq. 1)
    capped = await ctl(bus, Prewarm(idempotency_key="r-6", model="two", layers=LayerRange(start=0, end=1),
                                    cap_instance_id="w0-one", kv_cap_bytes=1 << 20))
    assert isinstance(capped, CtlRefused) and capped.code == "invalid" and "accepting" in capped.message
    gone = await ctl(bus, Prewarm(idempotency_key="r-7", model="two", layers=LayerRange(start=0, end=1),
                                  cap_instance_id="w0-nope", kv_cap_bytes=1 << 20))
    assert isinstance(gone, CtlRefused) and gone.code == "not_found"
    # an evict of an instance with running requests: refused without drain, nothing cut
    stream = await watch(bus, "m-long")
    a = msgspec.structs.replace(assignment("m-long", PROMPT, max_tokens=200), model="one", instance_id="w0-one")
    assert isinstance(await bus.request(worker_assign("w0"), a, AssignReply), AssignAccepted)
    busy = await ctl(bus, EvictModel(idempotency_key="r-5", model="one", drain=False))
    assert isinstance(busy, CtlRefused) and busy.code == "busy" and "drain=true" in busy.message
    await stream.wait(timeout=60)
    assert isinstance(stream.final, TokenChunk) and stream.final.finish_reason == "length"


async def test_evict_drains_then_keeps_the_weights_warm_and_a_load_reads_no_checkpoint(bus: Bus, setup: Setup) -> None:
    serving = await latest_stats(bus, lambda m: any(i.model == "one" for i in m.instances))
    weights = serving.pool.weights_bytes
    stream = await watch(bus, "m-drain")
    a = msgspec.structs.replace(assignment("m-drain", PROMPT, max_tokens=120), model="one", instance_id="w0-one")
    assert isinstance(await bus.request(worker_assign("w0"), a, AssignReply), AssignAccepted)
    evict = await ctl(bus, EvictModel(idempotency_key="e-1", model="one"))
    assert isinstance(evict, CtlDone) and "running ones finish" in evict.detail
    late = msgspec.structs.replace(assignment("m-late", PROMPT), model="one", instance_id="w0-one")
    refused = await bus.request(worker_assign("w0"), late, AssignReply)
    assert isinstance(refused, AssignRejected) and refused.reason == "model_not_loaded"
    await stream.wait(timeout=60)  # the running request finished: drained, not cut
    assert isinstance(stream.final, TokenChunk) and stream.final.finish_reason == "length"
    warm = await latest_stats(bus, lambda m: not m.instances and m.pool.prewarm_bytes > 0)
    assert warm.pool.prewarm_bytes == weights and warm.pool.weights_bytes == 0 and warm.pool.kv_bytes == 0
    assert any(h.kind == "prewarm" and h.owner.startswith("prewarm/one:") for h in warm.pool.holdings)
    # the checkpoint's weights are moved away: the start must come from the warm bytes alone
    weights_file = setup.models["one"] / "model.safetensors"
    hidden = weights_file.with_suffix(".moved")
    shutil.move(weights_file, hidden)
    try:
        done = await ctl(bus, LoadModel(idempotency_key="load-one-warm", model="one", instance_id="w0-one"))
        assert isinstance(done, CtlDone) and "checkpoint_opens=0" in done.detail and "warm weights" in done.detail
        assert await serve(bus, "one", "m-2") == expected_from(hidden, setup.models["one"])
    finally:
        shutil.move(hidden, weights_file)
    back = await latest_stats(bus, lambda m: any(i.model == "one" for i in m.instances))
    assert back.pool.prewarm_bytes == 0 and back.pool.weights_bytes == weights


def expected_from(moved: Path, model_dir: Path) -> list[int]:
    shutil.move(moved, model_dir / "model.safetensors")  # the oracle reads it; put it back after
    try:
        return expected(model_dir)
    finally:
        shutil.move(model_dir / "model.safetensors", moved)


async def test_a_prewarmed_first_layer_serves_while_the_rest_loads(bus: Bus, setup: Setup) -> None:
    warm = await ctl(bus, Prewarm(idempotency_key="p-1", model="two", layers=LayerRange(start=0, end=1)))
    assert isinstance(warm, CtlDone) and "[0, 1) warm" in warm.detail
    stats = await latest_stats(bus, lambda m: m.pool.prewarm_bytes > 0)
    assert any(h.owner.startswith("prewarm/two:layer0") for h in stats.pool.holdings)
    done = await ctl(bus, LoadModel(idempotency_key="load-two", model="two", instance_id="w0-two"))
    assert isinstance(done, CtlDone) and "1 warm layers + the checkpoint (loading while serving)" in done.detail
    assert await serve(bus, "two", "m-3") == expected(setup.models["two"])


async def test_grace_period_ends_and_the_warm_bytes_are_freed(tmp_path: Path, setup: Setup) -> None:
    """A second worker with a short grace period: evicted weights are warm, then freed."""
    config = tmp_path / "short.toml"
    config.write_text(CONFIG.format(one=setup.models["one"], two=setup.models["two"], big=tmp_path, grace="1s")
                      .replace('id = "w0"', 'id = "w9"'))
    proc = ServiceProcess("gpu_worker", setup.url, config, "worker-short", "--worker-id", "w9", "--threads", "1",
                          "--stats-interval", "0.1").start()
    bus = await Bus.connect(BusSettings(url=setup.url), service="test")
    try:
        await wait_ready(bus, proc, timeout=60)
        load = LoadModel(idempotency_key="g-1", model="one", instance_id="w9-one")
        assert isinstance(await bus.request(worker_ctl("w9"), load, CtlReply, timeout=30), CtlDone)
        evict = await bus.request(worker_ctl("w9"), EvictModel(idempotency_key="g-2", model="one"), CtlReply)
        assert isinstance(evict, CtlDone) and "kept warm for 1s" in evict.detail
        assert evict.pool is not None and evict.pool.prewarm_bytes > 0 and evict.pool.weights_bytes == 0

        async def freed() -> WorkerStats | None:
            return await latest_stats(bus, lambda m: m.worker_id == "w9" and m.pool.prewarm_bytes == 0
                                      and not m.instances)
        gone = await freed()
        assert gone.pool.free_bytes == gone.pool.capacity_bytes  # nothing of the model is left in the pool
    finally:
        await bus.close()
        proc.stop()
