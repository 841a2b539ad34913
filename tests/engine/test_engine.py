"""LLMEngine end to end on a generated checkpoint (CPU, fp32): the real runner, no mocks."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.memory_pool import PoolExhausted
from services.gpu_worker.engine.sampling_params import SamplingParams

PROMPTS = [
    "The Jargon File is a glossary of hacker slang.",
    "hello",
    "A hacker is a person who enjoys exploring the details of programmable systems and how to stretch them.",
    "kludge, n.",
    "Hacker culture began in the 1960s around the TMRC model railroad club at MIT, and its words spread.",
    "foo bar baz quux",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"), arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)


def engine(model_dir: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), **{"pool_bytes": 64 << 20, "block_size": 4, **kw}))


def test_preemption_under_a_small_pool_gives_the_same_greedy_tokens(model_dir: Path) -> None:
    reference = engine(model_dir).generate(PROMPTS, GREEDY)
    # ~50 tokens per sequence x 2 layers / 4 per block = 26 blocks each; 60 blocks hold two.
    small = engine(model_dir, kv_blocks=60, max_num_batched_tokens=16, max_num_seqs=4)
    constrained = small.generate(PROMPTS, GREEDY)
    assert small.scheduler.num_preemptions > 0
    assert [r.token_ids for r in constrained] == [r.token_ids for r in reference]
    assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in constrained)
    assert small.blocks.num_used_blocks == 0
    assert len({tuple(r.token_ids) for r in reference}) > 1  # outputs depend on the prompt


def test_abort_frees_blocks_within_one_step(model_dir: Path) -> None:
    eng = engine(model_dir)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        eng.step()
    used = eng.blocks.num_used_blocks
    held = eng.blocks.num_blocks_of("r1")
    assert held > 0
    assert eng.abort("r1") and not eng.abort("r1")
    assert eng.blocks.num_used_blocks == used - held  # freed before the next step
    outputs = {o.request_id: o for o in eng.step()}
    assert outputs["r1"].finished and outputs["r1"].finish_reason == "abort" and outputs["r1"].new_token_ids == []
    assert not outputs["r0"].finished and len(outputs["r0"].new_token_ids) == 1
    assert all(o.request_id != "r1" for o in eng.step())


def test_same_seed_same_tokens_whatever_the_batch(model_dir: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = engine(model_dir).generate([PROMPTS[0]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=9, ignore_eos=True) for _ in PROMPTS[1:]]
    batched = engine(model_dir, max_num_batched_tokens=32, max_num_seqs=8).generate(PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:], others[:2] + [seeded] + others[2:])
    assert batched[2].token_ids == alone
    other_seed = engine(model_dir).generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_deltas_text_stop_strings_and_logprobs(model_dir: Path) -> None:
    eng = engine(model_dir)
    full = eng.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2))[0]
    assert full.text == eng.tokenizer.decode(full.token_ids)
    assert len(full.logprobs) == 30 and all(lp <= 0 for lp in full.logprobs)
    # stop at a piece of the text the model really produces, spanning a token boundary if possible
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    stopped = eng.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert eng.blocks.num_used_blocks == 0


def test_drop_layers_gives_blocks_next_step_and_restore_preempts_when_asked(model_dir: Path) -> None:
    eng = engine(model_dir)
    before = eng.blocks.num_blocks
    weights = eng.pool.breakdown()["weights"]
    leftover = eng.pool.free_bytes  # less than one block
    released = eng.drop_layers(1, 2)
    assert released > 0 and eng.pool.breakdown()["weights"] == weights - released
    eng.step()  # nothing to run: the step still turns the freed bytes into blocks
    assert eng.blocks.num_blocks == before + (leftover + released) // eng.blocks.block_bytes
    eng.restore_layers(1, 2)  # free blocks are given back
    assert eng.blocks.num_blocks <= before and eng.pool.breakdown()["weights"] == weights
    assert eng.runner.resident_layers() == [0, 1]


def test_restore_waits_for_live_kv_or_preempts_it(model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = engine(model_dir).generate([PROMPTS[2]], params)[0].token_ids
    eng = engine(model_dir)
    eng.add_request("live", PROMPTS[2], params)
    tokens = [t for _ in range(5) for o in eng.step() for t in o.new_token_ids]
    eng.drop_layers(1, 2)  # e.g. a buddy peer serves layer 1 for a while
    eng.blocks.sync_with_pool()  # what the next step does first
    live_blocks = eng.blocks.num_blocks_of("live")
    layer_bytes = eng.runner.model.layers[0].nbytes
    need = -(-(layer_bytes - eng.pool.free_bytes) // eng.blocks.block_bytes)  # blocks to give back
    assert need > 1 and live_blocks >= 2
    # Something outside the scheduler (say, KV being imported) holds all but need-1 or need-2 free blocks.
    hog = eng.blocks.num_free_blocks - (need - 1)
    hog += hog % 2  # a multiple of the 2 held layers
    assert eng.blocks.allocate("hog", hog // 2 * eng.blocks.block_size)
    free = eng.blocks.num_free_blocks
    assert free < need <= free + live_blocks
    with pytest.raises(PoolExhausted):
        eng.restore_layers(1, 2)  # live KV is never given up unasked
    assert eng.blocks.num_blocks_of("live") == live_blocks and eng.runner.resident_layers() == [0]
    eng.restore_layers(1, 2, preempt=True)
    assert eng.runner.resident_layers() == [0, 1] and eng.blocks.num_blocks_of("live") == 0
    out = eng.scheduler.schedule()
    assert out.preempted == ["live"] and out.is_empty  # waits: the hog still holds the blocks
    eng.scheduler.update(out, [])
    eng.blocks.free("hog")
    while eng.has_unfinished:
        tokens += [t for o in eng.step() for t in o.new_token_ids]
    assert tokens == reference  # resumed by recompute: identical to a run that never dropped


def test_bad_requests_are_refused_by_name(model_dir: Path) -> None:
    eng = engine(model_dir)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("x", [1, 99999])
    with pytest.raises(ValueError, match="adapter"):
        eng.add_request("y", "hi", adapter="nope")
    with pytest.raises(ValueError, match="context length"):
        eng.add_request("z", [5] * 5000)
    eng.add_request("dup", "hi")
    with pytest.raises(ValueError, match="already"):
        eng.add_request("dup", "hi")


def test_an_adapter_that_finds_kv_full_waits_then_runs(model_dir: Path, tmp_path: Path) -> None:
    from services.gpu_worker.engine.checkpoint_gen import make_lora

    lora = make_lora(tmp_path / "lora", model_dir, rank=16, targets=["q", "k", "v", "o", "gate", "up", "down"])
    probe = engine(model_dir)
    probe.add_lora("a", lora)
    adapter_bytes = probe.runner.lora.host["a"].nbytes
    fixed = probe.pool.breakdown()["weights"] + probe.pool.breakdown()["workspace"]
    block = probe.blocks.block_bytes
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = probe.generate([PROMPTS[2], PROMPTS[0]], params, adapters=[None, "a"])
    # Room for both sequences' KV, or for one sequence's KV and the adapter, not for all three.
    eng = engine(model_dir, pool_bytes=fixed + adapter_bytes + 40 * block, workspace_bytes=probe.pool.breakdown()["workspace"])
    eng.add_lora("a", lora)
    results = eng.generate([PROMPTS[2], PROMPTS[0]], params, adapters=[None, "a"])
    assert eng.scheduler.num_preemptions > 0  # the adapter's request sat out while KV was full
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    # An adapter larger than everything the pool can give is refused, not retried forever.
    tiny = engine(model_dir, pool_bytes=fixed + adapter_bytes // 2, workspace_bytes=probe.pool.breakdown()["workspace"])
    tiny.add_lora("a", lora)
    (res,) = tiny.generate([PROMPTS[1]], params, adapters=["a"])
    assert res.finish_reason == "error" and "LoRA" in res.error


def test_the_prefill_pace_counts_prompt_tokens_in_prefill_steps_only(model_dir: Path) -> None:
    eng = engine(model_dir, max_num_batched_tokens=8, max_num_seqs=4)  # the prompt goes in chunks of 8, 8, 8, 6
    eng.add_request("r0", list(range(20, 50)), GREEDY)  # 30 prompt tokens
    eng.step()
    assert eng.prefill_tokens == 8 and eng.prefill_s > 0
    while eng.has_unfinished:
        eng.step()
    assert eng.prefill_tokens == 30  # every prompt token once; the 23 one-token decode steps add nothing
