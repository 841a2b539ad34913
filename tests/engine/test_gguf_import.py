"""`tidal import-gguf` on the real SmolLM2-135M-Instruct GGUF, with transformers as the oracle.

The checkpoint is imported once per session (tests/gguf_assets.py, as `tidal up` does). Our
engine's greedy tokens must equal transformers' `generate` on the imported directory, our
tokenizer and chat template must equal `AutoTokenizer`'s, and bad files are refused with a
message (no traceback).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_assets import SMOLLM, session_config, smollm_checkpoint, smollm_gguf
from services.gpu_worker.demo_assets import ensure_demo_assets
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.gguf_import import GGUFImportError, import_gguf, unpermute_rotary
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.tokenizer import EngineTokenizer
from tidal.cli import main as tidal_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
TEXTS = ["What is the capital of France?", "Numbers 12345 and 3.14, it's  <|im_start|>user\nhi", "naïve café\n\n  spaces"]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm_checkpoint(tmp_path_factory)


def test_imported_checkpoint_is_smollm2_and_cached(smollm: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg = json.loads((smollm / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (30, 576, 9, 3, 1536, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    reader = gguf.GGUFReader(smollm_gguf())
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    assert (smollm / "chat_template.jinja").read_text() == template and "<|im_start|>" in template
    # the second `tidal up` finds it imported
    assert ensure_demo_assets(session_config(tmp_path_factory), models=[SMOLLM]) == []


def test_greedy_tokens_equal_transformers_generate(smollm: Path) -> None:
    engine = LLMEngine(EngineConfig(str(smollm), max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
                                    num_threads=1))
    assert engine.tokenizer is not None
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = engine.generate(ids, SamplingParams(temperature=0, max_tokens=16))
    hf = AutoModelForCausalLM.from_pretrained(smollm, dtype=torch.float32)
    for prompt, out in zip(ids, ours):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == expected, (engine.tokenizer.decode(prompt), out.text)
    assert "Paris" in ours[0].text  # a trained model, not random weights


def test_tokenizer_and_chat_template_equal_transformers(smollm: Path) -> None:
    ours = EngineTokenizer.from_dir(smollm)
    hf = AutoTokenizer.from_pretrained(smollm)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        ids = hf(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    with_system = [{"role": "system", "content": "Answer briefly."}, *chat,
                   {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    for messages in (chat, with_system):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == text
        assert ours.encode_chat(messages) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_token_ids == {hf.convert_tokens_to_ids("<|im_end|>")}  # a turn ends the generation


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for n_head in (1, 3, 6):
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)
        assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, n_head), n_head), w)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = tidal_main(["import-gguf", *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def test_refuses_truncated_and_non_gguf_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(smollm_gguf(), "rb") as f:
        truncated.write_bytes(f.read(20 << 20))  # the metadata and a few tensors
    code, err = _cli(capsys, str(truncated), str(tmp_path / "out"))
    assert code == 2 and "truncated or corrupt GGUF" in err and "truncated.gguf" in err
    text = tmp_path / "notes.gguf"
    text.write_text("these are notes, not a model\n")
    code, err = _cli(capsys, str(text), str(tmp_path / "out"))
    assert code == 2 and "not a GGUF file" in err
    code, err = _cli(capsys, str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    assert code == 2 and "cannot read" in err
    assert not (tmp_path / "out").exists()  # nothing written


def _tiny_gguf(path: Path, arch: str, q_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_context_length(128)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    block, size = gguf.GGML_QUANT_SIZES[q_type]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32 // block * size), np.uint8), raw_dtype=q_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_refuses_other_architectures_and_undequantizable_types(tmp_path: Path) -> None:
    with pytest.raises(GGUFImportError, match=r"architecture 'qwen2' is not supported: only \['llama'\]"):
        import_gguf(_tiny_gguf(tmp_path / "qwen.gguf", "qwen2"), tmp_path / "out")
    with pytest.raises(GGUFImportError, match=r"\['Q8_1'\] cannot be dequantized"):
        import_gguf(_tiny_gguf(tmp_path / "q81.gguf", "llama", gguf.GGMLQuantizationType.Q8_1), tmp_path / "out")
    with pytest.raises(GGUFImportError, match="tokenizer.ggml.model None is not supported"):
        import_gguf(_tiny_gguf(tmp_path / "notok.gguf", "llama"), tmp_path / "out")  # no vocabulary in it
