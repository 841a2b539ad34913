"""Engine-level resume (what a re-dispatched assignment relies on), in process, no I/O.

A request re-submitted with the tokens another engine already produced must continue as
if it had never been interrupted: same remaining tokens (greedy, and seeded sampling),
same text continuation, usage counting the resumed tokens, max_tokens including them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.outputs import RequestOutput
from services.gpu_worker.engine.sampling_params import SamplingParams

PROMPT = "A hacker is a person who enjoys exploring the details of programmable systems."
OTHERS = ["hello there", "kludge, n. a clever programming trick", "foo bar baz"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"), arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=512, seed=5)


def run(model_dir: Path, params: SamplingParams, resume: list[int] | None = None,
        others: bool = False) -> list[RequestOutput]:
    """The deltas of request "me" (optionally batched with other requests)."""
    eng = LLMEngine(EngineConfig(str(model_dir), pool_bytes=64 << 20, block_size=4, max_num_batched_tokens=64))
    if others:
        for i, prompt in enumerate(OTHERS):
            eng.add_request(f"other{i}", prompt, SamplingParams(temperature=0.9, max_tokens=40))
    eng.add_request("me", PROMPT, params, resume_token_ids=resume)
    deltas = []
    while eng.has_unfinished:
        deltas += [d for d in eng.step() if d.request_id == "me"]
    assert eng.blocks.num_used_blocks == 0
    return deltas


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=30, ignore_eos=True),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 13, 29])
def test_resume_continues_exactly_like_an_uninterrupted_run(model_dir: Path, params: SamplingParams, cut: int) -> None:
    full = run(model_dir, params)
    tokens = [t for d in full for t in d.new_token_ids]
    assert len(tokens) == 30 and full[-1].finish_reason == "length"
    resumed = run(model_dir, params, resume=tokens[:cut], others=True)
    assert [t for d in resumed for t in d.new_token_ids] == tokens[cut:]
    # The text continues where the first engine's deltas stopped (nothing repeated, nothing lost).
    assert "".join(d.new_text for d in full[:cut]) + "".join(d.new_text for d in resumed) == "".join(
        d.new_text for d in full)
    assert resumed[-1].finished and resumed[-1].finish_reason == "length"
    assert resumed[-1].completion_tokens == 30 and resumed[-1].prompt_tokens == full[-1].prompt_tokens


def test_seeded_sampling_differs_with_the_seed_and_ignores_the_batch(model_dir: Path) -> None:
    a = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    b = SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True)
    alone = [t for d in run(model_dir, a) for t in d.new_token_ids]
    assert [t for d in run(model_dir, a, others=True) for t in d.new_token_ids] == alone
    assert [t for d in run(model_dir, b) for t in d.new_token_ids] != alone


def test_resume_that_leaves_nothing_to_generate_is_refused(model_dir: Path) -> None:
    eng = LLMEngine(EngineConfig(str(model_dir), pool_bytes=64 << 20, block_size=4))
    with pytest.raises(ValueError, match="nothing to generate"):
        eng.add_request("r", PROMPT, SamplingParams(max_tokens=3), resume_token_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("r", PROMPT, SamplingParams(max_tokens=9), resume_token_ids=[5, 10_000])
