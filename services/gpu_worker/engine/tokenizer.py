"""Tokenizers: train a byte-level BPE for generated checkpoints, load a checkpoint's, render chats.

`train_tokenizer` trains a real byte-level BPE (Hugging Face `tokenizers`) on the public
domain text shipped beside this module, with BOS/EOS and chat-marker special tokens;
`save_tokenizer` writes `tokenizer.json` + `tokenizer_config.json` (with a jinja chat
template) in the Hugging Face layout. `EngineTokenizer.from_dir` loads any checkpoint's
tokenizer and its chat templates (chat_template.jinja and additional_chat_templates/*.jinja, else
tokenizer_config's `chat_template`, a string or named {name, template} entries); they
render in a sandboxed jinja environment.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers import models as tok_models

CORPUS_PATH = Path(__file__).with_name("tokenizer_corpus.txt")

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"

# chat format -> (special tokens after BOS/EOS/PAD, end-of-turn token, jinja template)
CHAT_FORMATS: dict[str, tuple[list[str], str, str]] = {
    "chatml": (
        ["<|im_start|>", "<|im_end|>"],
        "<|im_end|>",
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    ),
    "llama3": (
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
}


class TokenizerError(ValueError):
    pass


def train_tokenizer(vocab_size: int = 1024, *, chat_format: str = "chatml", corpus: str | None = None) -> Tokenizer:
    """A byte-level BPE with `vocab_size` entries (specials included), deterministic for a corpus."""
    if chat_format not in CHAT_FORMATS:
        raise TokenizerError(f"unknown chat format {chat_format!r}; known: {sorted(CHAT_FORMATS)}")
    specials = [BOS, EOS, PAD, *CHAT_FORMATS[chat_format][0]]
    minimum = 256 + len(specials)
    if vocab_size < minimum:
        raise TokenizerError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {minimum}")
    text = corpus if corpus is not None else CORPUS_PATH.read_text(encoding="utf-8")
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    # Like Llama 3: BOS is prepended when encoding with special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def save_tokenizer(tok: Tokenizer, model_dir: str | Path, *, chat_format: str = "chatml", model_max_length: int = 2048) -> dict[str, int | list[int]]:
    """Write tokenizer.json and tokenizer_config.json; returns the ids a generation_config needs
    (`bos_token_id`, `eos_token_id` as a list: end of text and end of turn, `pad_token_id`)."""
    specials, end_of_turn, template = CHAT_FORMATS[chat_format]
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in [BOS, EOS, PAD, *specials]
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": template,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(end_of_turn)],
        "pad_token_id": tok.token_to_id(PAD),
    }


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as {'content': ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class EngineTokenizer:
    """A checkpoint's tokenizer: encode/decode, special ids, chat template."""

    def __init__(self, tok: Tokenizer, config: dict[str, Any], generation_eos: list[int] | None = None,
                 chat_templates: dict[str, str] | None = None) -> None:
        self.tok = tok
        self.config = config
        # name -> jinja source; "default" is what a chat renders with unless a name is asked
        self.chat_templates = chat_templates if chat_templates else _config_templates(config)
        self.chat_template: str | None = self.chat_templates.get("default")
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = {tok.token_to_id(self.eos_token)} if self.eos_token else set()
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos | set(generation_eos or []) if i is not None)
        self.special_token_ids = frozenset(int(i) for i in config.get("added_tokens_decoder", {}))
        self._compiled: dict[str, Any] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> EngineTokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: missing tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        gen_path = model_dir / "generation_config.json"
        gen_eos: list[int] = []
        if gen_path.is_file():
            value = json.loads(gen_path.read_text()).get("eos_token_id")
            gen_eos = [value] if isinstance(value, int) else list(value or [])
        return cls(tok, config, gen_eos, _file_templates(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_name: str | None = None, **extra: Any) -> str:
        """Render with the named template (None: "default"); `extra` reaches the template as variables."""
        name = template_name or "default"
        if name not in self.chat_templates:
            if not self.chat_templates:
                raise TokenizerError("this tokenizer has no chat template (chat_template.jinja or "
                                     "tokenizer_config.json's chat_template)")
            raise TokenizerError(f"no chat template named {name!r}; this tokenizer has {sorted(self.chat_templates)}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TokenizerError(f"chat message {i} needs string 'role' and 'content', got {m!r}")
        template = self._compiled.get(name)
        if template is None:
            template = self._compiled[name] = _sandbox().from_string(self.chat_templates[name])
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_name: str | None = None, **extra: Any) -> list[int]:
        """`extra` reaches the template (e.g. `tools`, as Hugging Face's apply_chat_template passes it)."""
        # The template already writes BOS: no second one from the post-processor.
        text = self.apply_chat_template(messages, add_generation_prompt, template_name, **extra)
        return self.encode(text, add_special_tokens=False)


def _config_templates(config: dict[str, Any]) -> dict[str, str]:
    """tokenizer_config's `chat_template`: one string, or a list of {name, template} (named templates)."""
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


def _file_templates(model_dir: Path) -> dict[str, str]:
    """chat_template.jinja ("default") and additional_chat_templates/NAME.jinja, as recent transformers saves them;
    when any exists they take priority over tokenizer_config.json's entries (as in transformers)."""
    out: dict[str, str] = {}
    default = model_dir / "chat_template.jinja"
    if default.is_file():
        out["default"] = default.read_text(encoding="utf-8")
    named = model_dir / "additional_chat_templates"
    if named.is_dir():
        for path in sorted(named.glob("*.jinja")):
            out[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return out


def _sandbox():  # noqa: ANN202 - jinja2 types
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
