"""Token-mode migration between two real worker processes: MigrateIn/MigrateOut on the ctl
subjects move a running request; the client's stream goes on with consecutive sequence
numbers and exactly the tokens of an unmigrated greedy run, with or without an adapter,
mid-prefill or mid-decode; a destination that cannot take it leaves it on the source."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service_procs import ServiceProcess, wait_ready
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.instance import engine_params
from services.gpu_worker.loading import engine_config
from shared.bus import Bus, BusSettings, Delivery
from shared.config import load_config
from shared.events import AssignAccepted, AssignReply, Assignment, SamplingParams, StreamError, TokenChunk
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateOut
from shared.nats_server import NatsServer
from shared.subjects import request_out, worker_assign, worker_ctl

pytestmark = pytest.mark.timeout(180)

CONFIG = """
[cluster]
data_dir = "data"

[registry]
heartbeat_interval = "200ms"
dead_after = "1s"

[[models]]
name = "tiny"
path = "{model}"
max_context = 1024

[[adapters]]
name = "tiny-lora"
base = "tiny"
path = "{adapter}"
rank = 4
targets = ["q_proj", "v_proj"]

[[workers]]
id = "w0"
device = "cpu"
memory = "64MiB"
models = ["tiny"]
adapters = ["tiny-lora"]

[[workers]]
id = "w1"
device = "cpu"
memory = "64MiB"
models = ["tiny"]
adapters = ["tiny-lora"]

[policies]
max_batch_size = 16
step_token_budget = 64
kv_block_tokens = 8
"""
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    directory = tmp_path_factory.mktemp("migrate")
    model = make_model(directory / "tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    adapter = make_lora(directory / "tiny-lora", model, rank=4, targets=["q", "v"], seed=9)
    config = directory / "cluster.toml"
    config.write_text(CONFIG.format(model=model, adapter=adapter))
    nats = NatsServer(store_dir=directory / "nats").start()
    procs = [ServiceProcess("registry", nats.url, config, "registry-m").start()] + [
        ServiceProcess("gpu_worker", nats.url, config, f"worker-{w}", "--worker-id", w, "--threads", "1").start()
        for w in ("w0", "w1")]

    async def ready() -> None:
        bus = await Bus.connect(BusSettings(url=nats.url), service="test")
        try:
            for proc in procs:
                await wait_ready(bus, proc, timeout=90)
        finally:
            await bus.close()

    try:
        asyncio.run(ready())
        yield nats.url, config
    finally:
        for proc in reversed(procs):
            proc.stop()
        nats.stop()


@pytest.fixture(scope="module")
def reference(cluster: tuple[str, Path]) -> LLMEngine:
    cfg = load_config(cluster[1])
    worker = cfg.worker("w0")
    engine = LLMEngine(engine_config(cfg, worker, cfg.model("tiny"), int(worker.memory), threads=1))
    engine.add_lora("tiny-lora", str(cfg.adapter("tiny-lora").path))
    return engine


@pytest.fixture
async def bus(cluster: tuple[str, Path]):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster[0]), service="test")
    yield bus
    await bus.close()


class Stream:
    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []
        self.errors: list[StreamError] = []
        self.done = asyncio.Event()

    async def on(self, msg: TokenChunk | StreamError, _ctx: Delivery) -> None:
        (self.chunks if isinstance(msg, TokenChunk) else self.errors).append(msg)  # type: ignore[arg-type]
        if msg.final:
            self.done.set()


def assign(rid: str, prompt: list[int], adapter: str | None, max_tokens: int) -> Assignment:
    return Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id="w0-tiny", model="tiny", adapter=adapter,
                      prompt_token_ids=prompt, arrival_ts=time.time(),
                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def migrate(bus: Bus, rid: str, source: str, destination: str) -> CtlReply:
    if destination != "w9":  # w9 does not exist
        ready = await bus.request(worker_ctl(destination), MigrateIn(
            idempotency_key=f"in-{rid}", request_id=rid, source=source, instance_id=f"{destination}-tiny",
            mode="tokens"), CtlReply)
        assert isinstance(ready, CtlDone), ready
    return await bus.request(worker_ctl(source), MigrateOut(
        idempotency_key=f"out-{rid}", request_id=rid, destination=destination,
        destination_instance=f"{destination}-tiny", mode="tokens"), CtlReply, timeout=30)


@pytest.mark.parametrize("adapter", [None, "tiny-lora"], ids=["base", "lora"])
@pytest.mark.parametrize("when", ["mid-decode", "mid-prefill"])
async def test_migrated_greedy_request_yields_the_unmigrated_tokens(bus: Bus, reference: LLMEngine, adapter: str | None,
                                                                    when: str) -> None:
    rid = f"mig-{when}-{adapter or 'base'}"
    prompt = PROMPT * 40 if when == "mid-prefill" else PROMPT  # 320 tokens: 5 prefill steps of 64
    max_tokens = 400  # long enough to be still running when the migration arrives on a loaded machine
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    reply = await bus.request(worker_assign("w0"), assign(rid, prompt, adapter, max_tokens), AssignReply)
    assert isinstance(reply, AssignAccepted)
    if when == "mid-decode":
        while len(stream.chunks) < 3:
            await asyncio.sleep(0.002)
    moved = await migrate(bus, rid, "w0", "w1")
    assert isinstance(moved, CtlDone), moved
    await asyncio.wait_for(stream.done.wait(), 120)
    await asyncio.sleep(0.2)
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    assert not stream.errors
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # consecutive: no gap, no duplicate
    tokens = [t for c in chunks for t in c.token_ids]
    params = engine_params(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    assert tokens == reference.generate([prompt], params, adapters=[adapter])[0].token_ids
    owners = [c.worker_id for c in chunks]
    assert owners[-1] == "w1" and owners == sorted(owners)  # w0's chunks (if any), then only w1's
    if when == "mid-decode":
        assert owners[0] == "w0"
    final = chunks[-1]
    assert final.finish_reason == "length" and final.usage is not None
    assert final.usage.completion_tokens == max_tokens and final.usage.prompt_tokens == len(prompt)


async def test_destination_that_cannot_take_it_leaves_the_request_on_the_source(bus: Bus, reference: LLMEngine) -> None:
    rid = "mig-nowhere"
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    await bus.request(worker_assign("w0"), assign(rid, PROMPT, None, 150), AssignReply)
    while len(stream.chunks) < 3:
        await asyncio.sleep(0.002)
    refused = await migrate(bus, rid, "w0", "w9")  # no such worker: nobody answers its assign subject
    assert isinstance(refused, CtlRefused) and refused.code == "busy"
    await asyncio.wait_for(stream.done.wait(), 120)
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    assert [c.seq for c in chunks] == list(range(len(chunks))) and {c.worker_id for c in chunks} == {"w0"}
    params = engine_params(SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == reference.generate([PROMPT], params)[0].token_ids


async def test_unknown_requests_are_refused(bus: Bus) -> None:
    kv = await bus.request(worker_ctl("w0"), MigrateOut(idempotency_key="kv-1", request_id="nope", destination="w1",
                                                       destination_instance="w1-tiny", mode="kv"), CtlReply)
    assert isinstance(kv, CtlRefused) and kv.code == "not_found"  # KV mode: tests/transfer/test_migrate_kv.py
    gone = await bus.request(worker_ctl("w0"), MigrateOut(idempotency_key="t-1", request_id="nope", destination="w1",
                                                         destination_instance="w1-tiny", mode="tokens"), CtlReply)
    assert isinstance(gone, CtlRefused) and gone.code == "not_found"
