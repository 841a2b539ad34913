"""Runtime LoRA loading over HTTP (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

The cluster is real processes (nats-server, registry, dispatcher, gateway, two gpu_workers: w0
serves the llama and the qwen model, w1 the llama one); the adapter is made by `tidal make-lora`;
clients are the official `openai` client and httpx. The tests of the cluster run in file order
and leave no runtime adapter behind. The switch-off, authentication, routing and PEFT-directory
checks need no cluster: test_adapters_checks.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_headers_conformance, response_schema_conformance, status_code_conformance,
)

from e2e.assets import BLOCK_TOKENS, LLAMA, LORA, MAX_CONTEXT, QWEN, STEP_TOKEN_BUDGET, TinyAssets
from e2e.cluster import ClusterSpec, E2ECluster, WorkerProcess
from e2e.observer import Observer
from services.gateway.app import openapi_document
from shared.bus import Bus, BusSettings
from shared.config import load_config
from shared.events import (
    Bucket, CtlDone, CtlRefused, CtlReply, EvictAdapter, InstanceRecord, LoadAdapter, ModelRecord, WorkerState,
    WorkerStats,
)
from shared.registry_client import RegistryClient
from shared.subjects import worker_ctl

pytestmark = pytest.mark.timeout(180)

SWITCH = "TIDAL__GATEWAY__ALLOW_RUNTIME_LORA_UPDATING"
SPEC = ClusterSpec(workers={"w0": [LLAMA, QWEN], "w1": [LLAMA]})
PROMPT = "The tide comes in and"
RUNTIME = "rt-lora"
ADAPTER_ROUTES = schemathesis.openapi.from_dict(openapi_document(load_config())).include(path_regex="lora_adapter$")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def cluster(assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "true"  # the processes read it at start
    try:
        running = E2ECluster(tmp_path_factory.mktemp("cluster"), SPEC, assets).start()
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def offline(assets: TinyAssets, adapter_dir: Path):  # type: ignore[no-untyped-def]
    """The llama model in-process, configured as the workers configure theirs, with the runtime adapter."""
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model_dir=str(assets.models[LLAMA]), pool_bytes=64 << 20, block_size=BLOCK_TOKENS, max_num_seqs=8,
        max_num_batched_tokens=STEP_TOKEN_BUDGET, max_model_len=MAX_CONTEXT, dtype="float32", num_threads=1))
    engine.add_lora(RUNTIME, str(adapter_dir))

    def greedy(adapter: str | None, max_tokens: int, prompt: str = PROMPT, ignore_eos: bool = False) -> str:
        (result,) = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos), adapters=[adapter])
        return str(result.text)

    return greedy


def post(cluster: E2ECluster, path: str, body: Any) -> httpx.Response:
    return httpx.post(cluster.base_url + path, json=body, timeout=60)


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]


def listed(cluster: E2ECluster) -> dict[str, str | None]:
    return {m.id: getattr(m, "parent", None) for m in cluster.openai().models.list().data}


async def _registry(cluster: E2ECluster, work):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="cli")
    try:
        return await work(RegistryClient(bus, timeout=2.0), bus)
    finally:
        await bus.close()


async def instance_adapters(cluster: E2ECluster) -> dict[str, list[str]]:
    async def read(registry: RegistryClient, _bus: Bus) -> dict[str, list[str]]:
        entries = await registry.list(Bucket.INSTANCES)
        return {e.key: list(e.record.adapters) for e in entries if isinstance(e.record, InstanceRecord)}

    return await _registry(cluster, read)  # type: ignore[no-any-return]


def registered(stats: WorkerStats, model: str) -> set[str]:
    return {a for i in stats.instances if i.model == model for a in i.adapters}


# --- the cluster ---------------------------------------------------------------------------------
async def test_load_serve_and_unload_an_adapter_at_runtime(cluster: E2ECluster, adapter_dir: Path,
                                                           offline) -> None:  # type: ignore[no-untyped-def]
    observer = await Observer().start(cluster.nats_url)
    try:
        assert RUNTIME not in listed(cluster)
        with pytest.raises(openai.NotFoundError):
            await asyncio.to_thread(cluster.openai().completions.create, model=RUNTIME, prompt=PROMPT, max_tokens=4)

        # no base_model_name: the adapter's base_model_name_or_path names the llama checkpoint
        loaded = await asyncio.to_thread(post, cluster, "/v1/load_lora_adapter",
                                         {"lora_name": RUNTIME, "lora_path": str(adapter_dir)})
        assert loaded.status_code == 200, loaded.text
        body = loaded.json()
        assert body["id"] == RUNTIME and body["parent"] == LLAMA and body["object"] == "lora_adapter"
        assert body["workers"] == ["w0", "w1"] and body["failed"] == []  # every worker serving the base
        assert body["message"] == f"Success: LoRA adapter '{RUNTIME}' added successfully."
        assert listed(cluster)[RUNTIME] == LLAMA

        # served, at once, with the adapter's weights: as the engine run in-process with it
        client = cluster.openai()
        base_text = (await asyncio.to_thread(client.completions.create, model=LLAMA, prompt=PROMPT, max_tokens=24,
                                             temperature=0)).choices[0].text
        tuned = [(await asyncio.to_thread(client.completions.create, model=RUNTIME, prompt=PROMPT, max_tokens=24,
                                          temperature=0)) for _ in range(2)]
        for reply in tuned:
            assert reply.model == RUNTIME and reply.choices[0].text == offline(RUNTIME, 24)
        assert base_text == offline(None, 24) != tuned[0].choices[0].text  # the adapter changes the output
        chat = await asyncio.to_thread(client.chat.completions.create, model=RUNTIME, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.content is not None

        # every worker serving the base lists it: in its stats (what the dispatcher routes by) and its records
        for worker in ("w0", "w1"):
            stats = await observer.wait_for(lambda w=worker: next(
                (s for _at, s in reversed(observer.stats) if s.worker_id == w), None))
            assert RUNTIME in registered(stats, LLAMA) and LORA in registered(stats, LLAMA)
        records = await instance_adapters(cluster)
        assert all(RUNTIME in adapters for key, adapters in records.items() if LLAMA in key), records
        assert all(RUNTIME not in adapters for key, adapters in records.items() if QWEN in key), records

        # a second load of the name, or of the config's adapter, is a conflict
        again = await asyncio.to_thread(post, cluster, "/v1/load_lora_adapter",
                                        {"lora_name": RUNTIME, "lora_path": str(adapter_dir)})
        assert error_of(again, 409)["code"] == "adapter_already_loaded"
        assert error_of(await asyncio.to_thread(post, cluster, "/v1/load_lora_adapter", {
            "lora_name": LORA, "lora_path": str(adapter_dir), "base_model_name": LLAMA}), 409)["param"] == "lora_name"

        unloaded = await asyncio.to_thread(post, cluster, "/v1/unload_lora_adapter", {"lora_name": RUNTIME})
        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.json()["workers"] == ["w0", "w1"] and unloaded.json()["failed"] == []
        assert unloaded.json()["message"] == f"Success: LoRA adapter '{RUNTIME}' removed successfully."
        assert RUNTIME not in listed(cluster) and LORA in listed(cluster)
        with pytest.raises(openai.NotFoundError) as gone:
            await asyncio.to_thread(client.completions.create, model=RUNTIME, prompt=PROMPT, max_tokens=4)
        assert gone.value.code == "model_not_found"
        again = await asyncio.to_thread(post, cluster, "/v1/unload_lora_adapter", {"lora_name": RUNTIME})
        assert error_of(again, 404)["code"] == "model_not_found"
        since = time.time()
        for worker in ("w0", "w1"):
            stats = await observer.wait_for(lambda w=worker: next(
                (s for at, s in reversed(observer.stats) if s.worker_id == w and at > since), None))
            assert RUNTIME not in registered(stats, LLAMA) and LORA in registered(stats, LLAMA)
        assert all(RUNTIME not in adapters for adapters in (await instance_adapters(cluster)).values())
    finally:
        await observer.stop()


async def test_unload_lets_running_requests_finish_then_evicts(cluster: E2ECluster, adapter_dir: Path,
                                                               offline) -> None:  # type: ignore[no-untyped-def]
    name, max_tokens = "rt-drain", 400
    assert (await asyncio.to_thread(post, cluster, "/v1/load_lora_adapter", {
        "lora_name": name, "lora_path": str(adapter_dir), "base_model_name": LLAMA})).status_code == 200
    observer = await Observer().start(cluster.nats_url)
    body = {"model": name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 2:  # tokens are flowing: unload the adapter under the stream
                        (rid,) = observer.active()
                        (worker,) = set(observer.workers(rid))
                        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
                        assert unloaded.status_code == 200, unloaded.text
                        refused = await http.post("/v1/completions", json={"model": name, "prompt": "x"})
                        assert error_of(refused, 404)["code"] == "model_not_found"  # new requests: gone at once
                        # refused by the worker from now on, yet still on its device for the running request
                        draining = await observer.wait_for(lambda: next(
                            (s for _at, s in reversed(observer.stats) if s.worker_id == worker
                             and name not in registered(s, LLAMA)), None))
                        assert name in draining.resident_adapters
        ended = time.time()
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1])
        assert text == offline(RUNTIME, max_tokens, ignore_eos=True)  # same directory; not cut, not changed
        # once its last request ended, the worker dropped it from the engine (and the device)
        await observer.wait_for(lambda: any(
            at > ended + 0.3 and s.worker_id == worker and name not in s.resident_adapters
            for at, s in observer.stats), timeout=5)
    finally:
        await observer.stop()


async def test_errors_of_the_load_and_unload_routes(cluster: E2ECluster, adapter_dir: Path, tmp_path: Path) -> None:
    load = "/v1/load_lora_adapter"

    def refused(body: Any, status: int) -> dict[str, Any]:
        return error_of(post(cluster, load, body), status)

    assert (await asyncio.to_thread(refused, {"lora_name": "x"}, 400))["param"] == "lora_path"
    assert (await asyncio.to_thread(refused, [1, 2], 400))["code"] == "invalid_request_error"
    assert (await asyncio.to_thread(refused, {"lora_name": "org/x", "lora_path": str(adapter_dir)}, 400))["param"] \
        == "lora_name"
    assert (await asyncio.to_thread(refused, {"lora_name": LLAMA, "lora_path": str(adapter_dir)}, 400))["param"] \
        == "lora_name"
    missing = await asyncio.to_thread(refused, {"lora_name": "x", "lora_path": str(tmp_path / "nothing")}, 400)
    assert missing["param"] == "lora_path" and "No LoRA adapter found" in missing["message"]
    assert "adapter_config.json" in (await asyncio.to_thread(
        refused, {"lora_name": "x", "lora_path": str(tmp_path)}, 400))["message"]
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 128, "target_modules": ["q_proj"]}))
    assert "max_lora_rank (64)" in (await asyncio.to_thread(refused, {"lora_name": "x", "lora_path": str(big)}, 400))[
        "message"]
    assert (await asyncio.to_thread(refused, {"lora_name": "x", "lora_path": str(adapter_dir),
                                              "base_model_name": "nope"}, 400))["param"] == "base_model_name"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(adapter_dir, elsewhere)
    config = json.loads((elsewhere / "adapter_config.json").read_text())
    (elsewhere / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "some/model"}))
    ambiguous = await asyncio.to_thread(refused, {"lora_name": "x", "lora_path": str(elsewhere)}, 400)
    assert ambiguous["param"] == "base_model_name" and LLAMA in ambiguous["message"] and QWEN in ambiguous["message"]

    # the gateway cannot see this one is broken; every worker refuses it: 400, and nothing is left behind
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dir, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    bad = await asyncio.to_thread(refused, {"lora_name": "rt-broken", "lora_path": str(broken),
                                            "base_model_name": LLAMA}, 400)
    assert bad["param"] == "lora_path" and "rt-broken" in bad["message"]
    assert "rt-broken" not in listed(cluster)

    async def add_ghost(registry: RegistryClient, _bus: Bus) -> None:  # a base model no worker serves
        await registry.create(ModelRecord(name="ghost", path=str(adapter_dir), num_layers=2, max_context=64))

    async def drop_ghost(registry: RegistryClient, _bus: Bus) -> None:
        entry = await registry.get(Bucket.MODELS, "ghost")
        assert entry is not None and await registry.delete(Bucket.MODELS, "ghost", entry.revision)

    await _registry(cluster, add_ghost)
    try:
        deadline = time.monotonic() + 5
        while "ghost" not in listed(cluster) and time.monotonic() < deadline:  # the gateway's catalog follows
            await asyncio.sleep(0.05)
        unserved = await asyncio.to_thread(refused, {"lora_name": "x", "lora_path": str(adapter_dir),
                                                     "base_model_name": "ghost"}, 503)
        assert unserved["code"] == "model_unavailable"
    finally:
        await _registry(cluster, drop_ghost)
    assert "x" not in listed(cluster)

    unload = "/v1/unload_lora_adapter"
    assert error_of(await asyncio.to_thread(post, cluster, unload, {"lora_name": "no-such"}), 404)["code"] \
        == "model_not_found"
    assert error_of(await asyncio.to_thread(post, cluster, unload, {"lora_name": LLAMA}), 400)["param"] == "lora_name"
    assert error_of(await asyncio.to_thread(post, cluster, unload, {}), 400)["param"] == "lora_name"


async def test_worker_adapter_commands_are_idempotent(cluster: E2ECluster, adapter_dir: Path) -> None:
    async def run(_registry: RegistryClient, bus: Bus) -> None:
        async def ctl(msg: LoadAdapter | EvictAdapter) -> CtlReply:
            return await bus.request(worker_ctl("w1"), msg, CtlReply, timeout=30)  # type: ignore[no-any-return]

        load = LoadAdapter(idempotency_key="idem-load", adapter="rt-idem", base=LLAMA, path=str(adapter_dir))
        first, second = await ctl(load), await ctl(load)
        assert isinstance(first, CtlDone) and not first.replayed and first.worker_id == "w1"
        assert isinstance(second, CtlDone) and second.replayed and second.detail == first.detail
        other = await ctl(LoadAdapter(idempotency_key="idem-load", adapter="rt-other", base=LLAMA,
                                      path=str(adapter_dir)))
        assert isinstance(other, CtlRefused) and other.code == "conflict"
        no_base = await ctl(LoadAdapter(idempotency_key="idem-qwen", adapter="rt-q", base=QWEN, path=str(adapter_dir)))
        assert isinstance(no_base, CtlRefused) and no_base.code == "not_found"  # w1 serves no qwen instance
        evict = EvictAdapter(idempotency_key="idem-evict", adapter="rt-idem")
        done, replay = await ctl(evict), await ctl(evict)
        assert isinstance(done, CtlDone) and isinstance(replay, CtlDone) and replay.replayed
        gone = await ctl(EvictAdapter(idempotency_key="idem-evict-2", adapter="rt-idem"))
        assert isinstance(gone, CtlRefused) and gone.code == "not_found"

    await _registry(cluster, run)


async def test_a_worker_started_after_a_load_serves_the_adapter_too(cluster: E2ECluster, adapter_dir: Path,
                                                                    offline) -> None:  # type: ignore[no-untyped-def]
    name = "rt-adopt"
    loaded = await asyncio.to_thread(post, cluster, "/v1/load_lora_adapter", {
        "lora_name": name, "lora_path": str(adapter_dir), "base_model_name": LLAMA})
    assert loaded.status_code == 200 and loaded.json()["workers"] == ["w0", "w1"]
    observer = await Observer().start(cluster.nats_url)
    try:
        cluster.kill("w1")  # a new process of w1: it knows only the config's adapters, and then the catalog's
        restarted = time.time()
        cluster.procs["w1"] = WorkerProcess("gpu_worker", cluster.nats_url, cluster.config, "gpu_worker-w1-e2e",
                                            "--worker-id", "w1").start()
        await observer.wait_for(lambda: any(
            at > restarted and s.worker_id == "w1" and s.state is WorkerState.READY and name in registered(s, LLAMA)
            for at, s in observer.stats), timeout=90)

        async def live(registry: RegistryClient, _bus: Bus) -> bool:
            worker = await registry.get(Bucket.WORKERS, "w1")
            return worker is not None and worker.record.state == WorkerState.READY  # type: ignore[union-attr]

        deadline = time.monotonic() + 30
        while not await _registry(cluster, live):
            assert time.monotonic() < deadline, cluster.logs()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)  # the gateway's catalog follows the registry's events
        for _ in range(2):
            got = await asyncio.to_thread(cluster.openai().completions.create, model=name, prompt=PROMPT,
                                          max_tokens=16, temperature=0)
            assert got.choices[0].text == offline(RUNTIME, 16)  # same directory as RUNTIME
    finally:
        await observer.stop()
    unloaded = await asyncio.to_thread(post, cluster, "/v1/unload_lora_adapter", {"lora_name": name})
    assert unloaded.status_code == 200 and unloaded.json()["workers"] == ["w0", "w1"]


@ADAPTER_ROUTES.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_random_bodies_get_documented_4xx_answers_never_5xx(case: Any, cluster: E2ECluster) -> None:
    """Last of the cluster's tests: with the switch on, whatever the body, no 5xx and no schema violation."""
    response = case.call_and_validate(base_url=cluster.base_url, checks=CHECKS, timeout=60)
    assert response.status_code < 500
    assert LORA in listed(cluster)  # random names never unloaded the config's adapter
