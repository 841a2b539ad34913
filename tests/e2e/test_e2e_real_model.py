"""The default config's real model (SmolLM2-135M-Instruct, imported from its GGUF) served by the
real cluster: a chat completion through the gateway answers a factual question correctly."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from e2e.cluster import ClusterSpec, E2ECluster
from gguf_assets import SMOLLM, smollm_checkpoint

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class RealAssets:
    """What E2ECluster reads of its assets: model name -> directory, and no adapters."""

    models: dict[str, Path]
    adapters: dict[str, tuple[str, Path]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def smol_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    assets = RealAssets({SMOLLM: smollm_checkpoint(tmp_path_factory)})
    spec = ClusterSpec(workers={"w0": [SMOLLM]}, worker_memory="1GiB")
    running = E2ECluster(tmp_path_factory.mktemp("cluster"), spec, assets).start()  # type: ignore[arg-type]
    try:
        yield running
    finally:
        running.stop()


def chat(cluster: E2ECluster, content: str, **extra: object) -> dict:
    body = {"model": SMOLLM, "messages": [{"role": "user", "content": content}], "max_tokens": 32,
            "temperature": 0, **extra}
    request = urllib.request.Request(cluster.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


def test_chat_answers_the_capital_of_france(smol_cluster: E2ECluster) -> None:
    reply = chat(smol_cluster, "What is the capital of France?")
    choice = reply["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    # the model ends its turn with <|im_end|> (the GGUF's eos) well before max_tokens
    assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] < 32
    # the prompt is the GGUF's ChatML template with its default system turn
    assert reply["usage"]["prompt_tokens"] > 20
