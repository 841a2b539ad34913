"""The scheduler's "vllm-0.6" policy (prefill-first, whole prompts, watermark, recompute preemption
of the newest) against the default "chunked" one, without a model: a fake 'model' samples token 7."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.scheduler import Scheduler, SchedulerConfig
from services.gpu_worker.engine.scheduler_prefill_first import watermark_blocks
from services.gpu_worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.config import ConfigError, parse_config

BLOCK_BYTES = 64
LAYERS = 2
BS = 4  # tokens per block


def make(policy: str, token_blocks: int = 1000, **cfg: float) -> Scheduler:
    """`token_blocks` blocks of every layer (the engine counts one per layer)."""
    pool = MemoryPool(token_blocks * LAYERS * BLOCK_BYTES)
    bm = BlockManager(pool, block_size=BS, block_bytes=BLOCK_BYTES, layers=range(LAYERS))
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64,
                                "policy": policy, **cfg})
    return Scheduler(config, bm)


_order = iter(range(10**9))


def seq(sid: str, n_prompt: int, max_tokens: int = 4) -> Sequence:
    order = next(_order)
    return Sequence(seq_id=sid, prompt_token_ids=list(range(10, 10 + n_prompt)),
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=float(order),
                    arrival_order=order)


def step(s: Scheduler) -> dict[str, int]:
    """One step; returns request id -> tokens scheduled."""
    out = s.schedule()
    s.update(out, [7 for c in out.chunks if c.sample])
    return {c.seq_id: len(c.token_ids) for c in out.chunks}


def test_bad_policies_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="'vllm' is not one of chunked, vllm-0.6"):
        SchedulerConfig(policy="vllm")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_model_len \(128\)"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, policy="vllm-0.6")
    SchedulerConfig(max_num_batched_tokens=64, max_model_len=128)  # chunked splits long prompts: fine
    with pytest.raises(ConfigError, match="policies.scheduling"):
        parse_config('[policies]\nscheduling = "vllm"\n')
    assert parse_config('[policies]\nscheduling = "vllm-0.6"\n').policies.scheduling == "vllm-0.6"


def test_a_prefill_step_runs_no_decode() -> None:
    runs = {}
    for policy in ("chunked", "vllm-0.6"):
        s = make(policy)
        s.add(seq("a", 8, max_tokens=10))
        assert step(s) == {"a": 8}
        assert step(s) == {"a": 1}
        s.add(seq("b", 20))
        runs[policy] = step(s)
    assert runs["chunked"] == {"a": 1, "b": 20}  # decodes first, the prompt beside them
    assert runs["vllm-0.6"] == {"b": 20}  # the prompt alone; "a" waits a step


def test_prompts_are_admitted_whole_within_the_budget() -> None:
    runs = {}
    for policy in ("chunked", "vllm-0.6"):
        s = make(policy)
        for name in "abc":
            s.add(seq(name, 30))
        runs[policy] = [step(s), step(s)]
    assert runs["chunked"][0] == {"a": 30, "b": 30, "c": 4}  # the budget of 64 split into chunks
    # vllm-0.6: "c" does not fit in what "a" and "b" left; it waits (FCFS) for a whole step
    assert runs["vllm-0.6"] == [{"a": 30, "b": 30}, {"c": 30}]


def test_the_watermark_keeps_blocks_back() -> None:
    # 50 blocks of every layer, watermark 0.1: 5 kept back. "a" (prompt 160 = 40 blocks) fits;
    # "b" (prompt 24 = 6 blocks) would leave 4 < 5 free: it waits; chunked admits it at once.
    for policy, b_runs in (("chunked", True), ("vllm-0.6", False)):
        s = make(policy, token_blocks=50, max_num_batched_tokens=256, max_model_len=256, watermark=0.1)
        s.add(seq("a", 160, max_tokens=2))
        s.add(seq("b", 24, max_tokens=2))
        assert watermark_blocks(s) == 5 * LAYERS
        first = step(s)
        assert ("b" in first) is b_runs, policy
    assert s.get("b").status is SequenceStatus.WAITING
    while s.get("a") is not None:
        step(s)
    assert step(s) == {"b": 24}  # "a" freed its blocks: "b" runs


def test_a_request_that_could_never_fit_above_the_watermark_fails() -> None:
    s = make("vllm-0.6", token_blocks=20, max_num_batched_tokens=128, max_model_len=128, watermark=0.2)
    s.add(seq("big", 70))  # 18 blocks: 20 - 18 < 4 kept back
    s.add(seq("ok", 8))
    out = s.schedule()
    assert [c.seq_id for c in out.chunks] == ["ok"] and "big" in out.finished
    changed = s.update(out, [7])
    big = next(q for q in changed if q.seq_id == "big")
    assert big.finish_reason is FinishReason.ERROR and "KV blocks" in (big.error or "")


def test_decode_preempts_the_newest_by_recompute() -> None:
    # 12 blocks of 4 tokens; three prompts of 15 take 4 blocks each (all 12). The 16th tokens fit;
    # at the 17th "a" needs a 5th block: the newest ("c") is preempted and recomputed later whole.
    s = make("vllm-0.6", token_blocks=12, max_num_batched_tokens=64, max_model_len=64, watermark=0.0)
    for name in "abc":
        s.add(seq(name, 15, max_tokens=6))
    assert step(s) == {"a": 15, "b": 15, "c": 15}  # one prefill step, first tokens sampled
    assert step(s) == {"a": 1, "b": 1, "c": 1}  # 16 tokens fill their 4 blocks
    assert step(s) == {"a": 1, "b": 1}  # "c" was preempted for their 5th blocks
    c = s.get("c")
    assert c is not None and c.status is SequenceStatus.WAITING and c.num_preemptions == 1
    assert s.num_preemptions == 1 and s.stats()["num_preemptions"] == 1
    a, b = s.get("a"), s.get("b")
    seen = []
    while s.has_unfinished:
        seen.append(step(s))
    assert {"c": 17} in seen  # prompt + its two outputs, recomputed whole in a prefill-only step
    assert a is not None and b is not None and a.num_preemptions == b.num_preemptions == 0
    assert c.num_output_tokens == 6 and c.finish_reason is FinishReason.LENGTH  # the oldest were never the victims


def test_the_engine_generates_the_same_tokens_under_either_policy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # greedy outputs do not depend on how steps are built, even through recompute preemptions
    from services.gpu_worker.engine.checkpoint_gen import make_model
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    model = make_model(tmp_path / "m", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, max_position=256)
    prompts = [[5 + i, 9, 11 + 2 * i] * (6 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    results = {}
    for policy in ("chunked", "vllm-0.6"):
        engine = LLMEngine(EngineConfig(model_dir=str(model), kv_blocks=2 * 9, max_num_seqs=4, max_num_batched_tokens=96,
                                        max_model_len=96, num_threads=1, scheduling_policy=policy))
        results[policy] = [r.token_ids for r in engine.generate(prompts, params)]
        assert engine.scheduler.num_preemptions > 0, policy  # 9 blocks of 16 tokens: KV ran out
        assert all(len(t) == 40 for t in results[policy])
    assert results["chunked"] == results["vllm-0.6"]
