"""Fixtures of the gateway tests: a real trained tokenizer directory (no model weights needed);
tiny generated models and a LoRA adapter made by the CLI for the runtime-adapter tests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.assets import LLAMA, TinyAssets, make_assets
from service_procs import ROOT
from services.gpu_worker.engine.tokenizer import save_tokenizer, train_tokenizer

# A chat template that refuses `tool` turns, as some models' templates do.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory holding only tokenizer files (BPE, 512 entries, chatml template)."""
    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(512), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return make_assets(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def adapter_dir(assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new adapter of the llama model, made with the CLI (it names the llama directory as its base)."""
    out = tmp_path_factory.mktemp("runtime-lora") / "rt"
    argv = [sys.executable, "-m", "tidal.cli", "make-lora", str(out), "--base", str(assets.models[LLAMA]),
            "--rank", "8", "--targets", "q,v,o", "--seed", "21"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return out
