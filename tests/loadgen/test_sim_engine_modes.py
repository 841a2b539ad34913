"""The simulator's engine modes: our chunked scheduler vs vLLM 0.6 (prefill-first, whole prompts,
recompute preemption), and the occupancy timeline that shows why requests wait."""
from __future__ import annotations

import pytest

from loadgen.sim.profile import CostProfile, StepCost, WorkerSpec, load_profile
from loadgen.sim.run import simulate
from loadgen.sim.simulator import Simulator
from loadgen.sim.timeline import WorkerTimeline
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord
from shared.policy.routing_policies import make_policy

# a step is 10 ms plus 1 ms per prefill token: times below are exact sums
COST = StepCost(overhead_s=0.01, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, prefill_per_token_s=0.001,
                prefill_attn_s=0.0)


def profile(mode: str, **worker) -> CostProfile:
    return CostProfile(request_overhead_s=0.0, step=COST, worker=WorkerSpec(engine_mode=mode, **worker))


def trace_of(*recs: tuple[float, int, int]) -> Trace:
    records = [TraceRecord(arrival_s=t, model="m", prompt_tokens=p, output_tokens=o, request_id=f"r{i}")
               for i, (t, p, o) in enumerate(recs)]
    return Trace(header=TraceHeader(params=PoissonParams(), num_records=len(records), duration_s=10.0), records=records)


def finishes(mode: str, trace: Trace, **worker) -> dict[str, float]:
    res = simulate(trace, profile(mode, max_batched_tokens=4096, **worker), workers=1, check_invariants=True)
    assert all(r.status == "ok" for r in res.records)
    return {r.request_id: r.finish_s for r in res.records}


def test_a_vllm_prefill_step_stalls_the_running_decodes() -> None:
    # A: prompt 10, 5 tokens, first token at 20 ms then a token every 10 ms. B (prompt 100) arrives
    # during A's second decode step; the next step starts at 30 ms and takes 10 + 100 ms.
    trace = trace_of((0.0, 10, 5), (0.025, 100, 2))
    chunked = finishes("chunked", trace)
    vllm = finishes("vllm-0.6", trace)
    # chunked: A decodes inside B's prefill step (its 3rd token at 140 ms), then 150, 160 ms
    assert chunked["r0"] == pytest.approx(0.16)
    # vllm-0.6: that step is prefill only; A's 3rd..5th tokens come at 150, 160, 170 ms
    assert vllm["r0"] == pytest.approx(0.17)
    assert chunked["r1"] == vllm["r1"] == pytest.approx(0.15)


def test_vllm_refuses_a_prompt_over_its_token_budget() -> None:
    # budget 256: chunked splits a 600-token prompt into 3 steps; vllm-0.6 (no chunked prefill) ignores
    # a prompt over max_num_batched_tokens, as vLLM does -- the profile must carry the papers' budget
    chunked = simulate(trace_of((0.0, 600, 2)), profile("chunked", max_batched_tokens=256, max_batch=8), workers=1)
    assert chunked.records[0].status == "ok"
    res = simulate(trace_of((0.0, 600, 2), (0.1, 100, 2)), profile("vllm-0.6", max_batched_tokens=256, max_batch=8),
                   workers=1)
    refused, ok = sorted(res.records, key=lambda r: r.request_id)
    assert refused.status == "error" and "max_num_batched_tokens=256" in refused.error
    assert ok.status == "ok"  # the queue behind it is not blocked


def test_vllm_preempts_the_newest_by_recompute_and_everything_finishes() -> None:
    # 40 blocks of 16 tokens: four requests of 100 + 150 tokens cannot all hold their KV
    trace = trace_of(*[(0.001 * i, 100, 150) for i in range(4)])
    for mode in ("chunked", "vllm-0.6"):
        sim = Simulator(trace, profile(mode, kv_blocks=40, max_batched_tokens=4096), 1, make_policy("least-load"),
                        check_invariants=True)
        sim.workers[0].timeline = tl = WorkerTimeline(interval_s=0.0)
        res = sim.run()
        assert all(r.status == "ok" and r.output_tokens == 150 for r in res.records), mode
        assert res.stats.preemptions > 0, mode
        assert tl.kv_peak > 0.9
        assert any(s.waiting_memory > 0 for s in tl.samples), mode
        # the oldest request is never the victim: it finishes first
        first = min(res.records, key=lambda r: r.finish_s)
        assert first.request_id == "r0", mode


def test_vllm_watermark_keeps_blocks_back() -> None:
    # 100 blocks, watermark 0.1 -> 10 kept back: a 1400-token prompt (88 blocks) fits, a second
    # one waits for memory though 12 blocks are free
    trace = trace_of((0.0, 1400, 3), (0.0, 100, 3))
    sim = Simulator(trace, profile("vllm-0.6", kv_blocks=100, watermark=0.1, max_batched_tokens=4096), 1,
                    make_policy("least-load"), check_invariants=True)
    sim.workers[0].timeline = tl = WorkerTimeline(interval_s=0.0)
    res = sim.run()
    r0, r1 = sorted(res.records, key=lambda r: r.request_id)
    assert r1.first_token_s > r0.finish_s - 1e-9  # admitted only once r0 freed its blocks
    assert any(s.waiting_memory == 1 for s in tl.samples)


def test_engine_mode_is_validated(tmp_path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text('name = "x"\n[worker]\nengine_mode = "vllm-0.7"\n')
    with pytest.raises(ValueError, match="engine_mode 'vllm-0.7'"):
        load_profile(bad)


def test_simulate_records_each_workers_occupancy_when_asked() -> None:
    trace = trace_of(*[(0.001 * i, 100, 150) for i in range(8)])
    res = simulate(trace, profile("vllm-0.6", kv_blocks=40, max_batched_tokens=4096), workers=2,
                   occupancy_interval_s=0.01)
    assert set(res.occupancy) == {"w0", "w1"}
    samples = [s for v in res.occupancy.values() for s in v]
    assert max(s.kv_used for s in samples) > 0.9
    assert sum(v[-1].preemptions for v in res.occupancy.values()) == res.stats.preemptions
    assert simulate(trace, profile("chunked"), workers=2).occupancy == {}
