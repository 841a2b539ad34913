"""Chat templates as current checkpoints ship them, with transformers' AutoTokenizer as the oracle:
`chat_template.jinja` beside tokenizer_config.json, named templates (tokenizer_config's list of
{name, template}, or additional_chat_templates/NAME.jinja), and which one wins when several are present."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.gpu_worker.engine.tokenizer import EngineTokenizer, TokenizerError, save_tokenizer, train_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]
JINJA_FILE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
DEFAULT = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL_USE = "{% for m in messages %}TOOL-{{ loop.index }}:{{ m['content'] }};{% endfor %}"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(300), path, chat_format="chatml")
    return path


def variant(base: Path, tmp_path: Path, name: str, *, config_template: object = None,
            files: dict[str, str] | None = None) -> Path:
    """A copy of `base` with tokenizer_config's chat_template replaced (None: removed) and extra files."""
    out = tmp_path / name
    shutil.copytree(base, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if config_template is not None:
        config["chat_template"] = config_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    for rel, text in (files or {}).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    return out


def both(path: Path, name: str | None = None, generation_prompt: bool = True) -> tuple[str, str]:
    ours = EngineTokenizer.from_dir(path).apply_chat_template(CHAT, generation_prompt, name)
    hf = AutoTokenizer.from_pretrained(path).apply_chat_template(
        CHAT, chat_template=name, tokenize=False, add_generation_prompt=generation_prompt)
    return ours, hf


def test_chat_template_jinja_beside_the_config(base_dir: Path, tmp_path: Path) -> None:
    path = variant(base_dir, tmp_path, "jinja", files={"chat_template.jinja": JINJA_FILE})
    for generation_prompt in (True, False):
        ours, hf = both(path, generation_prompt=generation_prompt)
        assert ours == hf and ours.startswith("[SYSTEM] Be brief.")


def test_chat_template_jinja_wins_over_the_config_entry(base_dir: Path, tmp_path: Path) -> None:
    path = variant(base_dir, tmp_path, "both", config_template=DEFAULT, files={"chat_template.jinja": JINJA_FILE})
    ours, hf = both(path)
    assert ours == hf and ours.startswith("[SYSTEM]")


def test_named_templates_in_the_config(base_dir: Path, tmp_path: Path) -> None:
    path = variant(base_dir, tmp_path, "named", config_template=[
        {"name": "tool_use", "template": TOOL_USE}, {"name": "default", "template": DEFAULT}])
    ours, hf = both(path)
    assert ours == hf and ours.startswith("<|begin_of_text|><system>")  # "default" unless a name is asked
    ours, hf = both(path, "tool_use")
    assert ours == hf == "TOOL-1:Be brief.;TOOL-2:Hello there;TOOL-3:Hi.;TOOL-4:Bye;"
    tok = EngineTokenizer.from_dir(path)
    assert tok.encode_chat(CHAT, template_name="tool_use") == tok.encode(hf, add_special_tokens=False)
    with pytest.raises(TokenizerError, match=r"no chat template named 'chatml'; this tokenizer has \['default', 'tool_use'\]"):
        tok.apply_chat_template(CHAT, template_name="chatml")


def test_named_template_files(base_dir: Path, tmp_path: Path) -> None:
    path = variant(base_dir, tmp_path, "files", config_template=DEFAULT, files={
        "chat_template.jinja": JINJA_FILE, "additional_chat_templates/tool_use.jinja": TOOL_USE})
    for name in (None, "tool_use"):
        ours, hf = both(path, name)
        assert ours == hf
    assert sorted(EngineTokenizer.from_dir(path).chat_templates) == ["default", "tool_use"]


def test_no_template_is_a_clear_error(base_dir: Path, tmp_path: Path) -> None:
    path = variant(base_dir, tmp_path, "none")
    with pytest.raises(TokenizerError, match="has no chat template"):
        EngineTokenizer.from_dir(path).apply_chat_template(CHAT)
