"""The default config's real model (SmolLM2-135M-Instruct, imported from its GGUF) served by the
real cluster: a chat completion through the gateway answers a factual question correctly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from e2e.cluster import ClusterSpec, E2ECluster
from gguf_assets import SMOLLM, smollm_checkpoint
from shared.config import load_config
from tidal.demo import usage_banner

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


def banner_snippets(text: str) -> tuple[str, str]:
    """The curl command and the openai heredoc, line for line as the banner prints them (no re-indenting)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "curl -sN" in line)
    end = next(i for i in range(start, len(lines)) if not lines[i].rstrip().endswith("\\"))
    first = next(i for i, line in enumerate(lines) if "<<'EOF'" in line)
    last = next(i for i in range(first + 1, len(lines)) if lines[i].strip() == "EOF")
    return "\n".join(lines[start:end + 1]) + "\n", "\n".join(lines[first:last + 1]) + "\n"


def test_the_banners_snippets_run_as_printed(smol_cluster: E2ECluster) -> None:
    """What `tidal up` prints once the gateway serves, pasted into a shell as it is."""
    curl, heredoc = banner_snippets(usage_banner(load_config(smol_cluster.config), smol_cluster.base_url))
    # the snippet names the venv's interpreter (it has openai): no venv on PATH is needed
    assert heredoc.startswith(f"{sys.executable} - <<'EOF'") or heredoc.startswith(".venv/bin/python - <<'EOF'")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    for snippet in (curl, heredoc):
        done = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0 and not done.stderr.strip(), f"{snippet}\n---\n{done.stdout}{done.stderr}"
        assert "Paris" in done.stdout, f"{snippet}\n---\n{done.stdout}"
