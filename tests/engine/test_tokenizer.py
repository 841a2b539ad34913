"""Byte-level BPE training, HF-layout save/load, chat templates, incremental detokenization."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gpu_worker.engine.detokenizer import IncrementalDetokenizer
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.tokenizer import (
    BOS,
    EngineTokenizer,
    TokenizerError,
    save_tokenizer,
    train_tokenizer,
)

TEXT = "Hackers say ‘foo’ — 漢字とかな 🎉🚀 naïve café, then a stop: END of story 👍🏽."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    ids = save_tokenizer(train_tokenizer(512), path, chat_format="chatml")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["eos_token_id"]}))
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> EngineTokenizer:
    return EngineTokenizer.from_dir(model_dir)


def test_training_is_deterministic_and_sized() -> None:
    a, b = train_tokenizer(400), train_tokenizer(400)
    assert a.get_vocab_size() == 400
    assert a.to_str() == b.to_str()
    with pytest.raises(TokenizerError, match="too small"):
        train_tokenizer(100)


def test_roundtrip_and_special_tokens(tok: EngineTokenizer) -> None:
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id  # BOS prepended like Llama 3
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert len(tok.encode("the hackers", add_special_tokens=False)) <= 3  # merges learned from the corpus
    assert len(tok.eos_token_ids) == 2  # end of text + end of turn from generation_config


def test_loads_with_transformers_too(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    ours = EngineTokenizer.from_dir(model_dir)
    assert hf.encode(TEXT) == ours.encode(TEXT)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ours.apply_chat_template(messages)


def test_chat_template_renders_and_is_sandboxed(tok: EngineTokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == f"{BOS}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(tok.bos_token_id) == 1
    with pytest.raises(TokenizerError, match="message 0"):
        tok.apply_chat_template([{"role": "user"}])
    evil = EngineTokenizer(tok.tok, {**tok.config, "chat_template": "{{ messages.__class__.__mro__ }}"})
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def stream(tok: EngineTokenizer, text: str, **params: object) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tok.encode("Prompt:")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    deltas = [detok.add(i) for i in tok.encode(text, add_special_tokens=False)]
    if detok.stop_string is None:
        deltas.append(detok.flush())
    return deltas, detok


def test_deltas_never_split_a_character(tok: EngineTokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) / 3  # emoji and CJK really are split across tokens
    deltas, _ = stream(tok, TEXT)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens ended mid-character and had to wait


def test_stop_string_spanning_tokens_is_cut_and_never_leaked(tok: EngineTokenizer) -> None:
    deltas, detok = stream(tok, TEXT, stop=["END of"])
    assert detok.stop_string == "END of"
    # deltas only ever append, so no part of the stop string was shown at any point
    assert "".join(deltas) == TEXT[: TEXT.index("END of")]
    deltas, detok = stream(tok, TEXT, stop=["END of"], include_stop_str_in_output=True)
    assert "".join(deltas) == TEXT[: TEXT.index("END of") + len("END of")]


def test_stop_string_inside_multibyte_text_and_false_starts(tok: EngineTokenizer) -> None:
    deltas, detok = stream(tok, TEXT, stop=["🚀 na"])
    assert "".join(deltas) == TEXT[: TEXT.index("🚀 na")]
    text = "ENDgame ENDless END of it"
    deltas, detok = stream(tok, text, stop=["END of"])
    assert "".join(deltas) == "ENDgame ENDless "  # partial matches were held, then released
    deltas, detok = stream(tok, "no stop here EN", stop=["END"])
    assert detok.stop_string is None and "".join(deltas) == "no stop here EN"  # flushed at the end
    assert deltas[-1].endswith("EN")  # held back until the flush


def test_special_tokens_are_skipped_in_text(tok: EngineTokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("x"), SamplingParams())
    eos = min(tok.eos_token_ids)
    out = [detok.add(i) for i in tok.encode("ok", add_special_tokens=False) + [eos]] + [detok.flush()]
    assert "".join(out) == "ok"
