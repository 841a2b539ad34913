"""The pressure fidelity check's parts without a cluster: the engine's own scheduler replayed on the
profile's step times makes the simulator's decisions exactly (both engine modes, KV running out);
the worker's pool is sized to the KV budget; preemptions reach the snapshot the stats are made of;
the comparison's errors, goals and summary line."""
from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from loadgen.profiler.scheduler_replay import replay
from loadgen.report.metrics import summarize_records
from loadgen.sim.profile import CostProfile, StepCost, WorkerSpec
from loadgen.sim.run import simulate
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord
from tidal.bench.fidelity_cluster import StatsWatch
from tidal.bench.fidelity_compare import Side, errors, goals_met, summary_line, table

COST = StepCost(overhead_s=0.008, decode_per_seq_s=9e-5, decode_per_ctx_token_s=7e-7, prefill_per_token_s=3e-4,
                prefill_attn_s=2e-7)


def random_trace(seed: int, n: int = 150, rate: float = 3.0) -> Trace:
    rng = random.Random(seed)
    t, records = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        records.append(TraceRecord(arrival_s=t, model="m", prompt_tokens=rng.randint(5, 300),
                                   output_tokens=rng.randint(1, 200), request_id=f"r{i}"))
    return Trace(header=TraceHeader(params=PoissonParams(), num_records=n, duration_s=t), records=records)


@pytest.mark.parametrize(("mode", "budget"), [("chunked", 64), ("chunked", 512), ("vllm-0.6", 512)])
def test_the_engine_scheduler_and_the_simulator_decide_alike_when_kv_runs_out(mode: str, budget: int) -> None:
    worker = WorkerSpec(kv_blocks=64, block_size=16, max_batch=16, max_batched_tokens=budget, max_model_len=512,
                        engine_mode=mode, watermark=0.01 if mode == "vllm-0.6" else 0.0)
    profile = CostProfile(request_overhead_s=0.003, step=COST, worker=worker)
    for seed in (0, 1):
        trace = random_trace(seed)
        sim = simulate(trace, profile, 1, check_invariants=True)
        real = replay(trace, profile)
        assert sim.stats.preemptions == real.preemptions > 20  # KV did run out, the same number of times
        got = {r.request_id: r for r in real.records}
        for r in sim.records:
            o = got[r.request_id]
            assert (r.status, r.output_tokens) == (o.status, o.output_tokens) == ("ok", r.output_tokens)
            assert r.first_token_s == pytest.approx(o.first_token_s, abs=1e-9), r.request_id
            assert r.finish_s == pytest.approx(o.finish_s, abs=1e-9), r.request_id


def test_the_replay_runs_the_engine_mode_the_profile_names() -> None:
    trace = random_trace(2)
    worker = WorkerSpec(kv_blocks=64, max_batch=16, max_batched_tokens=512, max_model_len=512)
    chunked = replay(trace, CostProfile(step=COST, worker=worker))
    vllm = replay(trace, CostProfile(step=COST, worker=msgspec.structs.replace(worker, engine_mode="vllm-0.6")))
    # prefill-first stalls the decodes of every admission step: the same requests finish later
    late = sum(v.finish_s > c.finish_s + 1e-9 for c, v in zip(chunked.records, vllm.records))
    assert late > len(trace.records) // 2


def test_the_pool_is_sized_to_the_kv_budget(tmp_path: Path) -> None:
    from loadgen.profiler.kv_budget import kv_budget
    from services.gpu_worker.engine.checkpoint_gen import make_model
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    model = make_model(tmp_path / "m", layers=3, hidden=64, heads=4, kv_heads=2, vocab=512, max_position=512)
    kv = kv_budget(model, kv_tokens=500, block_size=16, max_batch=4, max_batched_tokens=256, max_model_len=256)
    assert (kv.token_blocks, kv.layer_blocks) == (31, 93)  # 500 tokens: 31 whole blocks of 16, on 3 layers
    engine = LLMEngine(EngineConfig(model_dir=str(model), pool_bytes=kv.pool_bytes, max_num_seqs=4,
                                    max_num_batched_tokens=256, max_model_len=256, num_threads=1))
    assert engine.blocks.capacity_blocks == kv.layer_blocks
    with pytest.raises(ValueError, match="cannot hold one request of the context length 256"):
        kv_budget(model, kv_tokens=200, block_size=16, max_batch=4, max_batched_tokens=256, max_model_len=256)


def test_preemptions_reach_the_instance_snapshot(tmp_path: Path) -> None:
    from services.gpu_worker.engine.checkpoint_gen import make_model
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams
    from services.gpu_worker.instance_snapshot import take_snapshot

    model = make_model(tmp_path / "m", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, max_position=256)
    engine = LLMEngine(EngineConfig(model_dir=str(model), kv_blocks=2 * 6, max_num_seqs=4, max_num_batched_tokens=64,
                                    max_model_len=96, num_threads=1))  # 6 blocks of 16 tokens on each layer
    for i in range(3):
        engine.add_request(f"q{i}", [5 + i] * 20, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0))
    while engine.has_unfinished:
        engine.step()
    snap = take_snapshot(engine, tokens_emitted=0, steps=0)
    assert snap.preemptions == engine.scheduler.num_preemptions > 0


def test_the_stats_watch_counts_the_runs_own_preemptions() -> None:
    watch = StatsWatch()
    watch.observe("w0", preemptions=5, total=256, used=10)  # counted before the run: not its own
    watch.observe("w1", preemptions=0, total=256, used=0)
    watch.observe("w0", preemptions=12, total=256, used=256)
    watch.observe("w1", preemptions=3, total=256, used=128)
    assert watch.preemptions == 7 + 3
    assert watch.workers["w0"].kv_peak == 1.0 and watch.workers["w1"].kv_peak == 0.5


def summary(ttft: tuple[float, float], tpot: float, n: int = 20):  # type: ignore[no-untyped-def]
    """A report summary whose TTFT P50/P99 and TPOT P50 are about the given values."""
    records = []
    from loadgen.report.records import RequestRecord

    for i in range(n):
        first = ttft[0] if i < n - 1 else ttft[1] * 1.5  # one slow request drives the P99
        records.append(RequestRecord(request_id=f"r{i}", model="m", arrival_s=float(i), prompt_tokens=8,
                                     output_tokens=11, status="ok", first_token_s=i + first,
                                     finish_s=i + first + 10 * tpot))
    return summarize_records(records)


def test_errors_goals_and_the_summary_line() -> None:
    live = Side(summary=summary((0.1, 1.0), 0.010), preemptions=40, kv_peak=1.0)
    close = Side(summary=summary((0.11, 1.1), 0.011), preemptions=46, kv_peak=0.98)
    far = Side(summary=summary((0.2, 1.0), 0.010), preemptions=60, kv_peak=1.0)
    errs = errors(live, close)
    assert errs["ttft_p50"] == pytest.approx(0.1) and errs["tpot_p50"] == pytest.approx(0.1)
    assert errs["preemptions"] == pytest.approx(0.15)
    assert all(goals_met(errs).values())
    met = goals_met(errors(live, far))
    assert not met["ttft_p50"] and not met["preemptions"] and met["tpot_p50"]
    line = summary_line(live, close)
    assert line.startswith("bench fidelity: pressure_ttft_p99_err=")
    assert line.endswith("pressure_tpot_p50_err=10% preemptions_live=40 preemptions_sim=46")
    assert any("MISSED" in row for row in table(live, far))
    none = Side(summary=live.summary, preemptions=0, kv_peak=0.5)
    assert not goals_met(errors(none, close))["preemptions"]  # no live pressure: nothing compared
    assert goals_met(errors(none, none))["preemptions"]


def test_the_engine_replay_runs_the_real_engine_out_of_kv(tmp_path: Path) -> None:
    from loadgen.profiler.engine_replay import engine_replay
    from loadgen.profiler.kv_budget import kv_budget
    from services.gpu_worker.engine.checkpoint_gen import make_model

    model = make_model(tmp_path / "m", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, max_position=256)
    kv = kv_budget(model, kv_tokens=160, block_size=16, max_batch=4, max_batched_tokens=128, max_model_len=128)
    records = [TraceRecord(arrival_s=0.001 * i, model="m", prompt_tokens=40, output_tokens=40, request_id=f"r{i}")
               for i in range(6)]  # 4 at a time need 4 x 5 blocks at their end: more than 10
    trace = Trace(header=TraceHeader(params=PoissonParams(), num_records=6, duration_s=0.01), records=records)
    res = engine_replay(model, trace, pool_bytes=kv.pool_bytes, block_size=16, max_batch=4, max_batched_tokens=128,
                        max_model_len=128)
    assert res.preemptions > 0 and res.kv_peak == 1.0
    assert all(r.status == "ok" and r.first_token_s is not None for r in res.records)
    assert all(r.arrival_s <= r.first_token_s < r.finish_s for r in res.records)
    # FCFS: the first arrival is never the victim, so it is the first to finish
    assert min(res.records, key=lambda r: r.finish_s).request_id == "r0"
