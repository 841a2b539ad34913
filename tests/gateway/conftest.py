"""Fixtures of the gateway tests: a real trained tokenizer directory (no model weights needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

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
