"""`tidal repro mell --live`'s pure parts: the fragmenting trace, the bus samples' summary, the
simulator's run of the same trace, the plan-event tally and the summary line. (The live run itself
needs a cluster of real processes: `tidal repro mell --live`; the planner's live behaviour is
covered by tests/e2e/test_e2e_planner*.py.)"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from loadgen.repro.mell_live import LiveConfig, LiveRun, PhaseResult
from loadgen.repro.mell_live_report import live_headline
from loadgen.repro.mell_live_trace import LiveTraceSpec, SimCost, fragmenting_trace, simulate
from loadgen.repro.mell_live_watch import LiveSide, LiveWatch, WorkerSample, summarise
from loadgen.report.records import RequestRecord
from shared.events.plan import Migrate, Plan, PlanApplied, PlanDecided, PlanFailed

CAPACITY = 6000  # tokens of KV per worker
BPT = 512


def test_the_trace_is_seeded_mixes_long_and_short_of_two_models_and_leaves_out_of_order() -> None:
    spec = LiveTraceSpec()
    trace = fragmenting_trace(spec, CAPACITY)
    assert trace == fragmenting_trace(spec, CAPACITY)
    assert trace != fragmenting_trace(dataclasses.replace(spec, seed=1), CAPACITY)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert {r.model for r in trace} == set(spec.models)
    kinds = {r.request_id.rsplit("-", 1)[1] for r in trace}
    assert kinds == {"long", "short"}
    assert all(r.prompt_tokens + r.output_tokens < CAPACITY for r in trace)  # each fits one worker
    ends = [r.arrival_s + r.output_tokens for r in trace]  # at a fixed decode speed
    assert ends != sorted(ends)  # departures in another order than arrivals


def test_bad_trace_settings_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="too few"):
        fragmenting_trace(LiveTraceSpec(), 10)
    with pytest.raises(ValueError, match="long_share"):
        LiveTraceSpec(long_share=1.5)
    with pytest.raises(ValueError, match="fit one worker"):
        LiveTraceSpec(long_prompt=0.95)


def test_active_workers_and_their_kv_utilisation_are_sampled_on_a_grid() -> None:
    cap = 1000
    samples = {
        "w0": [WorkerSample(0.0, 1, 500, cap), WorkerSample(1.0, 0, 0, cap)],
        "w1": [WorkerSample(0.4, 2, 250, cap), WorkerSample(2.5, 0, 0, cap)],
        "w2": [WorkerSample(0.0, 0, 0, cap)],
    }
    side = summarise(samples, 0.0, 3.0, 0.5)  # ticks 0, 0.5, ..., 3.0
    assert side.active.tolist() == [1, 2, 1, 1, 1, 0, 0]
    assert side.utilisation[1] == pytest.approx(750 / 2000)
    assert side.busy().tolist() == [1, 2, 1, 1, 1]
    assert np.isnan(side.utilisation[-1])


def test_the_simulator_replays_the_same_trace_within_the_live_fleet() -> None:
    trace = fragmenting_trace(LiveTraceSpec(duration_s=20.0), CAPACITY)
    sim = simulate(trace, devices={"mell-a": 2, "mell-b": 2}, capacity_bytes=CAPACITY * BPT, bytes_per_token=BPT,
                   block_tokens=16, watermark=0.9, epoch_s=0.5, cost=SimCost(decode_step_s=0.006,
                                                                          prefill_s_per_token=1e-4))
    assert sim.active.max() <= 4 + sum(sim.extra_devices.values())
    assert 0 < sim.utilisation() <= 1
    assert sim.busy().mean() < 4  # MELL packs each model's requests onto fewer than its two workers on average


async def test_migrations_are_tallied_by_outcome_and_mode() -> None:
    watch = LiveWatch()
    for i, mode in enumerate(("kv", "tokens", "tokens")):
        action = Migrate(request_id=f"r{i}", source="w0", destination="w1", destination_instance="w1-m", mode=mode)
        await watch._on_plan(PlanDecided(plan=Plan(plan_id=f"p-{i}", ts=0.0, trigger="fragmentation",
                                                   actions=[action])), None)  # type: ignore[arg-type]
    await watch._on_plan(PlanApplied(plan_id="p-0", ts=1.0, duration_s=0.1), None)  # type: ignore[arg-type]
    await watch._on_plan(PlanFailed(plan_id="p-1", ts=1.0, action_index=0, message="refused"), None)  # type: ignore[arg-type]
    assert watch.migrations() == {"applied": {"kv": 1}, "failed": {"tokens": 1}, "open": {"tokens": 1}}
    assert watch.triggers == {"fragmentation": 3}


def _phase(name: str, active: list[int], trace, lost: int = 0) -> PhaseResult:  # type: ignore[no-untyped-def]
    records = [RequestRecord(request_id=r.request_id, model=r.model, arrival_s=r.arrival_s,
                             prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens - (i < lost))
               for i, r in enumerate(trace)]
    side = LiveSide(active=np.array(active), utilisation=np.full(len(active), 0.5), tick_s=0.5)
    return PhaseResult(name, side, records, {"applied": {"tokens": 3}} if name == "mell" else {}, {}, 1.0)


def test_the_summary_line_compares_mell_with_the_planner_off_and_the_simulator() -> None:
    trace = fragmenting_trace(LiveTraceSpec(duration_s=5.0), CAPACITY)
    sim = simulate(trace, devices={"mell-a": 2, "mell-b": 2}, capacity_bytes=CAPACITY * BPT, bytes_per_token=BPT,
                   block_tokens=16, watermark=0.9, epoch_s=0.5, cost=SimCost(0.006, 1e-4))
    run = LiveRun(LiveConfig(), trace, CAPACITY * BPT, BPT, 16, SimCost(0.006, 1e-4), sim=sim)
    run.phases = {"no-planner": _phase("no-planner", [0, 4, 4, 4, 0], trace),
                  "mell": _phase("mell", [0, 2, 2, 2, 0], trace, lost=1)}
    head = live_headline(run)
    assert head.gpus_vs_no_planner == pytest.approx(-0.5) and head.migrations == 3 and head.lost == 1
    line = head.line()
    assert re.fullmatch(r"repro mell \(live\): live_gpus_vs_no_planner=-50% sim_vs_live_gpus=[+-]\d+% "
                        r"sim_vs_live_peak=[+-]\d+ live_util=50% sim_util=\d+% migrations=3 sim_migrations=\d+ "
                        r"lost=1", line), line


def test_the_live_mell_repro_runs_mells_packer_not_the_live_default() -> None:
    """`[planner] packer` defaults to ours (RepackFit); the live MELL repro compares MELL, so it pins MELL."""
    from pathlib import Path

    from loadgen.repro.mell_live_cluster import PHASES, LiveClusterSpec
    from shared.config import ClusterConfig, parse_config

    cfg = parse_config(LiveClusterSpec(models={}, workers={}).toml(PHASES["mell"], Path("/tmp/unused"), 4222))
    assert cfg.planner.enabled and cfg.planner.packer == "mell" != ClusterConfig().planner.packer
