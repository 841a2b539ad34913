"""A real gpu_worker process on a real NATS (with a real registry): assignments, chunks,
aborts, resume, idempotency, typed refusals, stats and the catalog.

One worker process serves the whole module (start-up is the slow part); each test uses its
own request ids. Draining kills its worker, so it has its own (test_worker_drain.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from service_procs import eventually, local_cluster
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.instance import engine_params
from services.gpu_worker.loading import engine_config
from shared.bus import Bus, BusSettings
from shared.config import ClusterConfig, load_config
from shared.events import (
    AbortRequest, AssignAccepted, AssignRejected, AssignReply, Bucket, LoadModel, SamplingParams, TokenChunk,
    WorkerStats,
)
from shared.events.ctl import CtlReply
from shared.registry_client import RegistryClient
from shared.subjects import request_abort, worker_assign, worker_ctl, worker_stats
from shared.wire import RemoteError
from worker_harness import ADAPTER, INSTANCE, MODEL, assignment, make_assets, watch

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 300, 17, 99], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@dataclass
class Cluster:
    url: str
    cfg: ClusterConfig


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("worker")
    config = make_assets(directory)
    with local_cluster(directory) as services:
        services.start("registry", config, "registry-t")
        services.start("gpu_worker", config, "worker-w0", "--worker-id", "w0", "--threads", "1")
        services.wait_ready(timeout=60)
        yield Cluster(services.url, load_config(config))


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> LLMEngine:
    """The same model in process, configured as the worker configures it."""
    cfg = cluster.cfg
    worker = cfg.worker("w0")
    engine = LLMEngine(engine_config(cfg, worker, cfg.model(MODEL), int(worker.memory), threads=1))
    engine.add_lora(ADAPTER, str(cfg.adapter(ADAPTER).path))
    return engine


def in_process(engine: LLMEngine, prompt: list[int], params: SamplingParams, adapter: str | None = None) -> list[int]:
    return engine.generate([prompt], engine_params(params), adapters=[adapter])[0].token_ids


@pytest.fixture
async def bus(cluster: Cluster):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster.url), service="test")
    yield bus
    await bus.close()


async def test_assignment_streams_the_in_process_greedy_tokens(bus: Bus, reference: LLMEngine) -> None:
    streams = {}
    for i, prompt in enumerate(PROMPTS):
        rid = f"greedy-{i}"
        streams[rid] = await watch(bus, rid)
        reply = await bus.request(worker_assign("w0"), assignment(rid, prompt, max_tokens=20), AssignReply)
        assert reply == AssignAccepted(request_id=rid, worker_id="w0", instance_id=INSTANCE)
    for i, prompt in enumerate(PROMPTS):
        stream = await streams[f"greedy-{i}"].wait()
        assert [c.seq for c in stream.chunks] == list(range(len(stream.chunks)))
        assert all(c.worker_id == "w0" and c.request_id == f"greedy-{i}" for c in stream.chunks)
        final = stream.final
        assert isinstance(final, TokenChunk) and final.finish_reason == "length"
        assert final.usage is not None and final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == 20
        expected = in_process(reference, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert stream.tokens == expected
        assert stream.text == reference.tokenizer.decode(expected)  # type: ignore[union-attr]
        assert all(c.finish_reason is None for c in stream.chunks[:-1])


async def test_chunks_coalesce_under_load_with_the_first_token_alone(bus: Bus, reference: LLMEngine) -> None:
    """stream_interval = 20ms (worker_harness): steps take ~2 ms (the harness's floor), so later chunks
    carry several tokens; the first one is never held back; tokens, text and seqs stay exact."""
    prompts = [[1, 60 + i, 61 + i, 62 + i] for i in range(8)]
    streams = {}
    for i, prompt in enumerate(prompts):
        rid = f"coalesce-{i}"
        streams[rid] = await watch(bus, rid)
    replies = await asyncio.gather(*(bus.request(worker_assign("w0"), assignment(rid, p, max_tokens=64, logprobs=0),
                                                 AssignReply) for rid, p in zip(streams, prompts)))
    assert all(isinstance(r, AssignAccepted) for r in replies)
    sizes: list[int] = []
    for (rid, stream), prompt in zip(streams.items(), prompts):
        await stream.wait()
        chunks = stream.chunks
        assert [c.seq for c in chunks] == list(range(len(chunks))) and stream.final is chunks[-1]
        assert len(chunks[0].token_ids) == 1
        expected = in_process(reference, prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        assert stream.tokens == expected
        assert stream.text == reference.tokenizer.decode(expected)  # type: ignore[union-attr]
        assert [lp.token_id for c in chunks for lp in (c.logprobs or [])] == expected  # one logprob per token
        sizes += [len(c.token_ids) for c in chunks]
    assert max(sizes) > 1 and len(sizes) < 8 * 64 / 2  # several tokens per message on average


async def test_adapter_requests_use_the_adapter(bus: Bus, reference: LLMEngine) -> None:
    prompt = PROMPTS[0]
    with_lora = await watch(bus, "lora-1")
    await bus.request(worker_assign("w0"), assignment("lora-1", prompt, adapter=ADAPTER, logprobs=0), AssignReply)
    await with_lora.wait()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = in_process(reference, prompt, params, adapter=ADAPTER)
    assert with_lora.tokens == expected
    assert expected != in_process(reference, prompt, params)  # the adapter changes the output
    logprobs = [lp for c in with_lora.chunks for lp in (c.logprobs or [])]
    assert [lp.token_id for lp in logprobs] == expected and all(lp.logprob <= 0 for lp in logprobs)


async def test_redelivered_assignment_is_applied_once(bus: Bus) -> None:
    stream = await watch(bus, "idem-1")
    first = assignment("idem-1", PROMPTS[1], max_tokens=24)
    replies = await asyncio.gather(*(bus.request(worker_assign("w0"), first, AssignReply) for _ in range(3)))
    assert sorted(r.replayed for r in replies) == [False, True, True]  # type: ignore[union-attr]
    await stream.wait()
    again = await bus.request(worker_assign("w0"), first, AssignReply)
    assert isinstance(again, AssignAccepted) and again.replayed
    await asyncio.sleep(0.3)
    assert [c.seq for c in stream.chunks] == list(range(len(stream.chunks)))  # one run: no seq twice
    assert len(stream.tokens) == 24 and sum(1 for m in stream.messages if m.final) == 1


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.9, "seed": 4242},
], ids=["greedy", "seeded"])
async def test_resumed_assignment_continues_the_uninterrupted_stream(bus: Bus, sampling: dict) -> None:
    tag = "g" if sampling["temperature"] == 0 else "s"
    whole = await watch(bus, f"whole-{tag}")
    await bus.request(worker_assign("w0"), assignment(f"whole-{tag}", PROMPTS[2], max_tokens=30, **sampling), AssignReply)
    await whole.wait()
    tokens = whole.tokens
    assert len(tokens) == 30
    cut = 11  # the first worker "died" after 11 tokens, sent as chunks 0..10
    resumed = await watch(bus, f"resumed-{tag}")
    reply = await bus.request(worker_assign("w0"), assignment(
        f"resumed-{tag}", PROMPTS[2], attempt=1, resume=tokens[:cut], next_seq=cut, max_tokens=30, **sampling,
    ), AssignReply)
    assert isinstance(reply, AssignAccepted)
    await resumed.wait()
    assert [c.seq for c in resumed.chunks] == list(range(cut, cut + len(resumed.chunks)))
    assert resumed.tokens == tokens[cut:]
    assert resumed.text and whole.text.endswith(resumed.text)
    final = resumed.final
    assert isinstance(final, TokenChunk) and final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == 30


async def test_abort_frees_the_blocks_within_a_step(bus: Bus) -> None:
    stats: list[WorkerStats] = []

    async def on_stats(msg: WorkerStats, _ctx: object) -> None:
        stats.append(msg)

    await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    stream = await watch(bus, "abort-1")
    await bus.request(worker_assign("w0"), assignment("abort-1", PROMPTS[0], max_tokens=480), AssignReply)

    def busy() -> WorkerStats | None:
        return next((s for s in reversed(stats) if s.instances and s.instances[0].kv_blocks_used > 0), None)

    async def running() -> WorkerStats | None:
        return busy()

    during = await eventually(running, timeout=20)
    assert during.instances[0].running == 1 and during.instances[0].kv_blocks_used >= 2  # 2 layers
    sent = len(stream.chunks)
    await bus.publish(request_abort("abort-1"), AbortRequest(request_id="abort-1", reason="client_disconnected", ts=time.time()))
    await stream.wait(timeout=10)
    final = stream.final
    assert isinstance(final, TokenChunk) and final.finish_reason == "abort"
    assert final.usage is not None and sent <= final.usage.completion_tokens < 480
    stats.clear()

    async def freed() -> WorkerStats | None:
        return next((s for s in stats if s.instances and s.instances[0].kv_blocks_used == 0
                     and s.instances[0].running == 0), None)

    assert await eventually(freed, timeout=5)


async def test_refusals_are_typed(bus: Bus) -> None:
    other = msgspec.structs.replace(assignment("refuse-1", PROMPTS[0]), model="nope", instance_id="w0-nope")
    wrong_model = await bus.request(worker_assign("w0"), other, AssignReply)
    assert isinstance(wrong_model, AssignRejected) and wrong_model.reason == "model_not_loaded"
    no_adapter = await bus.request(worker_assign("w0"), assignment("refuse-2", PROMPTS[0], adapter="missing"), AssignReply)
    assert isinstance(no_adapter, AssignRejected) and no_adapter.reason == "adapter_unavailable"
    with pytest.raises(RemoteError) as bad:
        await bus.request(worker_assign("w0"), assignment("refuse-3", [1, 100_000]), AssignReply)
    assert bad.value.code == "bad_request" and "vocabulary" in bad.value.message
    with pytest.raises(RemoteError) as done:
        await bus.request(worker_assign("w0"), assignment("refuse-4", [1, 2], resume=[5, 6], max_tokens=2), AssignReply)
    assert done.value.code == "bad_request" and done.value.field == "resume_token_ids"
    ctl = await bus.request(worker_ctl("w0"), LoadModel(idempotency_key="k1", model=MODEL, instance_id="w0-x"), CtlReply)
    assert ctl.code == "busy"  # type: ignore[union-attr]  # w0-tiny serves it (test_worker_models.py: the rest)


async def test_stats_and_catalog(bus: Bus, cluster: Cluster) -> None:
    got: list[WorkerStats] = []

    async def on_stats(msg: WorkerStats, _ctx: object) -> None:
        got.append(msg)

    await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    await asyncio.sleep(0.7)
    assert 2 <= len(got) <= 5  # every 250 ms
    s = got[-1]
    assert s.worker_id == "w0" and s.state == "ready" and s.seq > got[0].seq
    pool = s.pool
    assert pool.capacity_bytes == 64 << 20 and pool.weights_bytes > 0 and pool.kv_bytes > 0
    assert pool.adapter_bytes > 0 and s.resident_adapters == [ADAPTER]  # listed in the worker's adapters
    assert (pool.weights_bytes + pool.prewarm_bytes + pool.adapter_bytes + pool.kv_bytes + pool.workspace_bytes
            + pool.free_bytes) == pool.capacity_bytes
    assert sum(h.bytes for h in pool.holdings) == pool.capacity_bytes - pool.free_bytes
    assert {h.layers.start for h in pool.holdings if h.layers is not None} == {0, 1}
    inst = s.instances[0]
    assert inst.instance_id == INSTANCE and inst.model == MODEL and inst.layers.end == 2 and inst.kv_blocks_total > 0

    registry = RegistryClient(bus)
    model = await registry.get(Bucket.MODELS, MODEL)
    assert model is not None and model.record.max_context == 512 and model.record.num_layers == 2
    assert Path(model.record.path, "tokenizer.json").is_file() and model.record.arch == "LlamaForCausalLM"
    adapter = await registry.get(Bucket.ADAPTERS, ADAPTER)
    assert adapter is not None and adapter.record.base == MODEL and adapter.record.rank == 4
    assert adapter.record.targets == ["q_proj", "v_proj"]
    instance = await registry.get(Bucket.INSTANCES, INSTANCE)
    assert instance is not None and instance.record.state == "ready" and instance.record.worker_id == "w0"


async def test_abort_that_overtakes_its_assignment_still_applies(bus: Bus) -> None:
    await bus.publish(request_abort("early-1"), AbortRequest(request_id="early-1", ts=time.time()))
    await bus.nc.flush()
    await asyncio.sleep(0.2)  # the worker has seen the abort before the assignment
    stream = await watch(bus, "early-1")
    reply = await bus.request(worker_assign("w0"), assignment("early-1", PROMPTS[0], max_tokens=400), AssignReply)
    assert isinstance(reply, AssignAccepted)
    await stream.wait(timeout=10)
    final = stream.final
    assert isinstance(final, TokenChunk) and final.finish_reason == "abort"
    assert final.usage is not None and final.usage.completion_tokens < 400
