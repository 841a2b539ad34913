"""A runtime LoRA load (`POST /v1/load_lora_adapter`) for a base model that no instance serves.

With `[dispatcher] scale_from_zero` (the default config) the load registers the adapter at once
(200, no worker yet) instead of answering 503 until something else requests the base; the next
request for the adapter starts an instance of the base (planner, capacity path), which adopts the
catalog's adapters and answers with the adapter's weights. Real processes: nats-server, registry,
dispatcher, planner, predictor, gateway and two gpu_workers, none of which serves the llama base.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.assets import BLOCK_TOKENS, LLAMA, MAX_CONTEXT, QWEN, STEP_TOKEN_BUDGET, TinyAssets
from e2e.cluster import ClusterSpec, E2ECluster

pytestmark = pytest.mark.timeout(300)

SWITCH = "TIDAL__GATEWAY__ALLOW_RUNTIME_LORA_UPDATING"
SPEC = ClusterSpec(workers={"w0": [QWEN], "w1": []}, control_plane=True, scale_from_zero=True,
                   extra_toml='[planner]\ninterval = "300ms"\nlease_ttl = "1s"\n')
NAME = "cold-lora"
PROMPT = "The tide comes in and"


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


def offline_text(assets: TinyAssets, adapter_dir: Path, max_tokens: int) -> str:
    """The llama model in-process with the adapter, configured as the workers configure theirs."""
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model_dir=str(assets.models[LLAMA]), pool_bytes=64 << 20, block_size=BLOCK_TOKENS, max_num_seqs=8,
        max_num_batched_tokens=STEP_TOKEN_BUDGET, max_model_len=MAX_CONTEXT, dtype="float32", num_threads=1))
    engine.add_lora(NAME, str(adapter_dir))
    (result,) = engine.generate([engine.tokenizer.encode(PROMPT)], SamplingParams(
        max_tokens=max_tokens, temperature=0.0), adapters=[NAME])
    return str(result.text)


def test_a_load_for_a_base_with_no_instance_registers_it_and_the_next_request_starts_the_base(
        cluster: E2ECluster, assets: TinyAssets, adapter_dir: Path) -> None:
    loaded = httpx.post(cluster.base_url + "/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": NAME, "lora_path": str(adapter_dir), "base_model_name": LLAMA})
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["id"] == NAME and body["parent"] == LLAMA and body["workers"] == [] and body["failed"] == []
    assert f"No instance of '{LLAMA}' runs now" in body["message"]
    listed = {m["id"] for m in httpx.get(cluster.base_url + "/v1/models", timeout=30).json()["data"]}
    assert NAME in listed

    # no instance of the base yet: the request waits in the dispatcher's queue, the planner starts the base,
    # the new instance adopts the adapter, and the answer carries the adapter's weights
    reply = httpx.post(cluster.base_url + "/v1/completions", timeout=240,
                       json={"model": NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == offline_text(assets, adapter_dir, 16)
