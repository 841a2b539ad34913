"""`tidal generate` as a user runs it: a real process on a generated checkpoint."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    model = make_model(root / "model", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=5)
    lora = make_lora(root / "lora", model, rank=4, seed=1)
    return model, lora


def tidal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal", *args], capture_output=True, text=True, timeout=120)


def test_generate_prints_the_engines_greedy_ids_and_text(dirs: tuple[Path, Path]) -> None:
    model, lora = dirs
    engine = LLMEngine(EngineConfig(str(model)))
    engine.add_lora("a", lora)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base, adapted = engine.generate(["The hacker ethic", "The hacker ethic"], params, adapters=[None, "a"])
    assert base.token_ids != adapted.token_ids  # the adapter changes the output

    ids = tidal("generate", str(model), "The hacker ethic", "--max-tokens", "12", "--ignore-eos", "--ids")
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.split() == [str(t) for t in base.token_ids]
    text = tidal("generate", str(model), "The hacker ethic", "--max-tokens", "12", "--ignore-eos")
    assert text.returncode == 0 and text.stdout == base.text + "\n"
    with_lora = tidal("generate", str(model), "The hacker ethic", "--max-tokens", "12", "--ignore-eos", "--ids",
                      "--adapter", str(lora))
    assert with_lora.stdout.split() == [str(t) for t in adapted.token_ids]


def test_generate_refuses_bad_input_clearly(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = dirs
    missing = tidal("generate", str(tmp_path / "nothing"), "hi")
    assert missing.returncode == 2 and "nothing" in missing.stderr and "Traceback" not in missing.stderr
    bad = tidal("generate", str(model), "hi", "--top-p", "0")
    assert bad.returncode == 2 and "top_p" in bad.stderr
