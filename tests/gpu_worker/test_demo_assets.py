"""Demo checkpoints are generated once, cached under data_dir, remade when their spec changes;
`tidal up`'s banner shows a working curl line and openai snippet for a served model."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from services.gpu_worker.demo_assets import AssetError, ensure_demo_assets, pending_demo_assets
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams
from shared.config import load_config, parse_config
from tidal.demo import usage_banner

CONFIG = """
[cluster]
data_dir = "data"

[[models]]
name = "demo-a"
max_context = 256
demo = {{ arch = "qwen2", layers = 1, hidden = 32, heads = 2, kv_heads = 1, intermediate = 64, vocab = 300, seed = {seed} }}

[[models]]
name = "unserved"
demo = {{ arch = "llama", layers = 1, hidden = 32, heads = 2, kv_heads = 1, intermediate = 64, vocab = 300 }}

[[adapters]]
name = "demo-a-lora"
base = "demo-a"
rank = 2
targets = ["q_proj"]
demo = {{ seed = 3 }}

[[workers]]
id = "cpu-0"
memory = "64MiB"
models = ["demo-a"]
"""


def test_generated_once_and_remade_when_the_spec_changes(tmp_path: Path) -> None:
    cfg = parse_config(CONFIG.format(seed=1), base_dir=tmp_path)
    assert pending_demo_assets(cfg, ["demo-a"]) == ["demo-a", "demo-a-lora"]
    assert ensure_demo_assets(cfg, models=["demo-a"]) == ["demo-a", "demo-a-lora"]
    model = tmp_path / "data" / "models" / "demo-a"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file()
    assert (tmp_path / "data" / "adapters" / "demo-a-lora" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "data" / "models" / "unserved").exists()  # only what was asked for
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_assets(cfg, models=["demo-a"]) == [] and pending_demo_assets(cfg, ["demo-a"]) == []
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp  # cached: not rewritten
    changed = parse_config(CONFIG.format(seed=2), base_dir=tmp_path)
    assert pending_demo_assets(changed, ["demo-a"]) == ["demo-a", "demo-a-lora"]  # the adapter follows its base
    assert ensure_demo_assets(changed, models=["demo-a"]) == ["demo-a", "demo-a-lora"]
    assert json.loads((model / ".tidal-demo.json").read_text())["demo"]["seed"] == 2
    assert not [p for p in model.parent.iterdir() if p.name.startswith(".")]  # no temporary directory left
    engine = LLMEngine(EngineConfig(str(model), pool_bytes=16 << 20))  # a servable checkpoint, with text
    engine.add_lora("demo-a-lora", tmp_path / "data" / "adapters" / "demo-a-lora")
    out = engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          adapters=["demo-a-lora"])[0]
    assert len(out.token_ids) == 8 and out.text


def test_banner_has_a_pasteable_curl_and_openai_snippet() -> None:
    cfg = load_config()  # the embedded default: what `make run` serves
    text = usage_banner(cfg, "http://127.0.0.1:8000")
    curl = next(line for line in text.splitlines() if "curl" in line)
    body_line = text.splitlines()[text.splitlines().index(curl) + 1]
    words = shlex.split(curl.rstrip("\\") + body_line)
    assert words[:3] == ["curl", "-sN", "http://127.0.0.1:8000/v1/chat/completions"]
    body = json.loads(words[words.index("-d") + 1])
    # the example calls the real trained model; only the random demo models are called gibberish
    assert body["model"] == "smollm2-135m-instruct" and body["messages"][0]["role"] == "user"
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in text and 'model="smollm2-135m-instruct"' in text
    assert "demo-llama-lora-r8" in text and "demo-qwen" in text
    assert "(demo-llama, demo-qwen: random weights" in text and "smollm2-135m-instruct:" not in text


def test_a_gguf_model_that_cannot_be_found_is_named(tmp_path: Path) -> None:
    cfg = parse_config('[cluster]\ndata_dir = "data"\n'
                       '[[models]]\nname = "from-pkg"\ngguf = { package = "no_such_package_x", file = "m.gguf" }\n'
                       '[[models]]\nname = "from-file"\ngguf = { file = "missing.gguf" }\n', base_dir=tmp_path)
    assert pending_demo_assets(cfg) == ["from-pkg", "from-file"]
    with pytest.raises(AssetError, match="model 'from-pkg': the Python package 'no_such_package_x' .* is not installed"):
        ensure_demo_assets(cfg, models=["from-pkg"])
    with pytest.raises(AssetError, match=f"model 'from-file': {tmp_path / 'missing.gguf'}: cannot read"):
        ensure_demo_assets(cfg, models=["from-file"])
    assert not (tmp_path / "data" / "models").exists() or not any((tmp_path / "data" / "models").iterdir())
