"""Automatic prefix caching end to end (CPU, generated checkpoint, the real runner): greedy tokens
are the same with the cache on and off, and the same as transformers', while the cache is hit —
a system prompt shared by concurrent requests, a multi-turn chat, preemption under a tiny KV
pool (both scheduling policies) and LoRA requests (an adapter never reuses the base's KV)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4
N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
SYSTEM = "You are a helpful hacker who answers in the words of the Jargon File, briefly and exactly. "
QUESTIONS = ["What is a kludge?", "foo bar", "Who wrote the Jargon File, and when did its words spread?", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"), arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=512, seed=3)


@pytest.fixture(scope="module")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tmp_path_factory.mktemp("lora"), model_dir, rank=8, targets=["q", "k", "v", "o", "up"], seed=5)


@pytest.fixture(scope="module")
def oracle(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy(prompt: list[int], n: int = N) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    return greedy


def engine(model_dir: Path, cache: bool = True, lora: Path | None = None, **kw: object) -> LLMEngine:
    eng = LLMEngine(EngineConfig(str(model_dir), **{"pool_bytes": 64 << 20, "block_size": BLOCK,
                                                    "prefix_caching": cache, **kw}))
    if lora is not None:
        eng.add_lora("a", lora)
    return eng


def tokens(eng: LLMEngine, prompts: list, **kw: object) -> list[list[int]]:
    return [r.token_ids for r in eng.generate(prompts, GREEDY, **kw)]


def hits(eng: LLMEngine) -> int:
    assert eng.prefix_cache is not None
    return eng.prefix_cache.hit_stats()[1]


def test_a_shared_system_prompt_is_computed_once_and_changes_no_token(model_dir: Path, oracle) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    off = engine(model_dir, cache=False)
    assert off.prefix_cache is None
    expected = tokens(off, prompts)
    # a small step budget: the first request's prefill spans steps, the others are admitted on its blocks
    on = engine(model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    assert tokens(on, prompts) == expected
    first = hits(on)
    assert first > 0
    assert tokens(on, prompts) == expected  # again, every prompt cached (its last token recomputed)
    system_blocks = len(on.tokenizer.encode(SYSTEM)) // BLOCK
    assert hits(on) - first >= len(prompts) * (system_blocks - 1)
    for prompt, got in zip(prompts, expected):
        assert got == oracle(on.tokenizer.encode(prompt))
    assert on.blocks.num_used_blocks == 0 and on.blocks.num_cached_blocks > 0


def test_multi_turn_reuses_the_previous_turns_kv(model_dir: Path, oracle) -> None:
    on, off = engine(model_dir), engine(model_dir, cache=False)
    turn1 = on.tokenizer.encode(SYSTEM + QUESTIONS[0])
    out1 = tokens(on, [turn1])[0]
    assert out1 == tokens(off, [turn1])[0]
    turn2 = turn1 + out1 + on.tokenizer.encode(" And a hack?")
    before = hits(on)
    out2 = tokens(on, [turn2])[0]
    # every full block of turn 1's prompt and outputs (the last output was never fed back) is reused
    assert hits(on) - before == (len(turn1) + len(out1) - 1) // BLOCK
    assert out2 == tokens(off, [turn2])[0] == oracle(turn2)


@pytest.mark.parametrize("policy", ["chunked", "vllm-0.6"])
def test_preemption_under_a_tiny_pool_keeps_tokens_with_the_cache_on(model_dir: Path, policy: str) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS] * 2
    kw: dict[str, object] = {"max_model_len": 128, "scheduling_policy": policy, "max_num_seqs": 4}
    kw.update({"max_num_batched_tokens": 128} if policy == "vllm-0.6" else {"max_num_batched_tokens": 16})
    expected = tokens(engine(model_dir, cache=False, **kw), prompts)
    # ~40 tokens per sequence x 2 layers / 4 per block = 20 blocks each: 60 hold few, cached or not
    small = engine(model_dir, kv_blocks=60, **kw)
    assert tokens(small, prompts) == expected
    assert small.scheduler.num_preemptions > 0 and hits(small) > 0
    assert small.blocks.num_used_blocks == 0


def test_lora_requests_never_share_with_the_base(model_dir: Path, lora_dir: Path) -> None:
    prompt = SYSTEM + QUESTIONS[2]
    off = engine(model_dir, cache=False, lora=lora_dir)
    base_ref = tokens(off, [prompt])[0]
    lora_ref = tokens(off, [prompt], adapters=["a"])[0]
    assert base_ref != lora_ref  # the adapter changes the KV, so sharing it would change tokens
    on = engine(model_dir, lora=lora_dir)
    assert tokens(on, [prompt])[0] == base_ref
    before = hits(on)
    assert tokens(on, [prompt], adapters=["a"])[0] == lora_ref
    assert hits(on) == before  # the base's cached blocks are not the adapter's
    assert tokens(on, [prompt, prompt], adapters=["a", None]) == [lora_ref, base_ref]
    assert hits(on) > before  # each hit its own
    on.remove_lora("a")  # the name may come back with other weights: its cached KV goes
    on.add_lora("a", lora_dir)
    before = hits(on)
    assert tokens(on, [prompt], adapters=["a"])[0] == lora_ref and hits(on) == before
