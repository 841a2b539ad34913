"""`tidal repro kunserve --live`'s pure pieces: the burst trace, the per-phase figures, the plan tally,
the cluster config per phase, the summary line and parsing it (the live run itself takes minutes)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from loadgen.repro.kunserve_live import PHASES, KunLiveClusterSpec
from loadgen.repro.kunserve_live_trace import (
    BurstSpec, LiveHeadline, PlanTally, burst_trace, live_headline, parse_line, phase_figures,
)
from loadgen.report.records import RequestRecord
from shared.config import parse_config
from shared.events.common import GroupMember, LayerRange
from shared.events.plan import DissolveGroup, FormGroup, Migrate, Plan, PlanApplied, PlanDecided, PlanFailed

SPEC = BurstSpec(calm_s=20.0, burst_s=10.0, tail_s=20.0, calm_rps=1.0, burst_factor=10.0)


def test_trace_is_seeded_calm_burst_calm_with_long_outputs_in_the_burst() -> None:
    a, b = burst_trace(SPEC), burst_trace(SPEC)
    assert a == b and a != burst_trace(dataclasses.replace(SPEC, seed=1))
    assert [r.request_id for r in a] == [f"kun-{i}" for i in range(len(a))]
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < SPEC.duration_s
    burst = [r for r in a if SPEC.calm_s <= r.arrival_s < SPEC.calm_s + SPEC.burst_s]
    calm = [r for r in a if r not in burst]
    assert 60 <= len(burst) <= 140  # about 10 rps x 10 s
    assert 20 <= len(calm) <= 60  # about 1 rps x 40 s: the burst is ~10x the calm rate
    assert all(SPEC.burst_output[0] <= r.output_tokens < SPEC.burst_output[1] for r in burst)
    assert all(SPEC.calm_output[0] <= r.output_tokens < SPEC.calm_output[1] for r in calm)
    assert all(SPEC.prompt_tokens[0] <= r.prompt_tokens < SPEC.prompt_tokens[1] and r.model == SPEC.model for r in a)


@pytest.mark.parametrize("bad", [{"burst_s": 0.0}, {"calm_rps": 0.0}, {"burst_factor": 0.5},
                                 {"burst_output": (10, 10)}, {"prompt_tokens": (0, 4)}])
def test_spec_refuses_bad_values_naming_them(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        BurstSpec(**bad)


def record(rid: str, arrival: float, first: float | None, times: list[float], tokens: int,
           status: str = "ok") -> RequestRecord:
    return RequestRecord(request_id=rid, model="kun-8l", arrival_s=arrival, prompt_tokens=8, output_tokens=tokens,
                         status=status, first_token_s=first, finish_s=times[-1] if times else None,  # type: ignore[arg-type]
                         token_times_s=times or None)


def test_figures_count_lost_streams_and_take_tbt_from_token_gaps() -> None:
    trace = burst_trace(BurstSpec(calm_s=0.0, burst_s=5.0, tail_s=0.0, calm_rps=3.0, burst_factor=1.0, seed=3))[:3]
    a, b, c = (r.request_id for r in trace)
    want = {r.request_id: r.output_tokens for r in trace}
    records = [record(a, 0.0, 0.1, [0.1 + 0.01 * k for k in range(want[a])], want[a]),
               record(b, 1.0, 1.5, [1.5 + 0.03 * k for k in range(want[b])], want[b]),
               record(c, 2.0, 2.2, [2.2, 2.21], 2)]  # short of its tokens: lost
    f = phase_figures("groups", trace, records)
    assert (f.requests, f.lost) == (3, 1) and f.lost_reasons[0].startswith(f"{c} ok 2/")
    assert f.ttft_p50_s == pytest.approx(0.3) and 0.49 < f.ttft_p99_s <= 0.5  # of the two complete
    assert 0.0099 <= f.tbt_p50_s <= 0.0301 and f.tbt_p99_s == pytest.approx(0.03)
    assert math.isnan(phase_figures("x", trace, []).ttft_p99_s) and phase_figures("x", trace, []).lost == 3


def test_tally_counts_kunserve_actions_by_outcome_and_ignores_others() -> None:
    members = [GroupMember(worker_id=f"w{i}", instance_id=f"w{i}-m", layers=LayerRange(start=4 * i, end=4 * i + 4))
               for i in range(2)]
    actions = {"p1": FormGroup(group_id="g", model="m", members=members), "p2": DissolveGroup(group_id="g"),
               "p3": DissolveGroup(group_id="g"),
               "p4": Migrate(request_id="r", source="w0", destination="w1", destination_instance="w1-m")}
    tally = PlanTally()
    for pid, action in actions.items():
        tally.add(PlanDecided(plan=Plan(plan_id=pid, ts=1.0, trigger="kv_pressure", actions=[action])))
    tally.add(PlanApplied(plan_id="p1", ts=2.0, duration_s=0.1))
    tally.add(PlanFailed(plan_id="p2", ts=2.0, action_index=0, message="busy"))
    tally.add(PlanApplied(plan_id="p3", ts=3.0, duration_s=0.1))
    tally.add(PlanApplied(plan_id="p4", ts=3.0, duration_s=0.1))
    assert dict(tally.decided) == {"form": 1, "dissolve": 2} and dict(tally.applied) == {"form": 1, "dissolve": 1}
    assert tally.failed == ["dissolve: busy"]
    assert "groups formed 1/1" in tally.brief() and "dissolved 1/2" in tally.brief()


def test_summary_line_round_trips_and_ratios_point_the_right_way() -> None:
    trace = burst_trace(BurstSpec(calm_s=0.0, burst_s=5.0, tail_s=0.0, calm_rps=2.0, burst_factor=1.0))[:1]
    rid, n = trace[0].request_id, trace[0].output_tokens
    fast = phase_figures("groups", trace, [record(rid, 0.0, 0.5, [0.5 + 0.04 * k for k in range(n)], n)])
    slow = phase_figures("no-groups", trace, [record(rid, 0.0, 2.0, [2.0 + 0.02 * k for k in range(n)], n)])
    head = live_headline(fast, slow)
    assert head.line() == "repro kunserve (live): live_p99_ttft_vs_no_groups=4.0x live_p50_tbt_vs_no_groups=2.00x"
    assert parse_line(head.line()) == LiveHeadline(4.0, 2.0)
    for bad in ("repro kunserve: p99_ttft_vs_replication=1.0x", "repro kunserve (live): live_p99_ttft_vs_no_groups=4x "
                "live_p50_tbt_vs_no_groups=2.00x"):
        with pytest.raises(ValueError, match="not a `repro kunserve \\(live\\)` summary line"):
            parse_line(bad)


def test_cluster_config_differs_between_phases_only_in_buddy_groups(tmp_path: Path) -> None:
    spec = KunLiveClusterSpec(models={"kun-8l": tmp_path / "m"}, workers={f"w{i}": ["kun-8l"] for i in range(4)},
                              memory="40MiB", max_batch=8, max_context=512)
    texts = {name: spec.toml(phase, tmp_path / "data", 8123) for name, phase in PHASES.items()}
    configs = {name: parse_config(text) for name, text in texts.items()}
    assert configs["groups"].policies.buddy_groups and not configs["no-groups"].policies.buddy_groups
    assert texts["groups"].replace("buddy_groups = true", "buddy_groups = false") == texts["no-groups"]
    cfg = configs["groups"]
    assert cfg.planner.enabled and cfg.policies.migration == "off" and len(cfg.workers) == 4
    assert all(float(w.stream_interval) == 0 and int(w.memory) == 40 << 20 for w in cfg.workers)


def test_cli_refuses_bad_live_settings_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tidal.cli import main

    assert main(["repro", "kunserve", "--live", "--workers", "1", "--out", str(tmp_path)]) == 2
    assert "--workers must be >= 2" in capsys.readouterr().err
    assert main(["repro", "kunserve", "--live", "--memory", "lots", "--out", str(tmp_path)]) == 2
    assert "workers[0].memory" in capsys.readouterr().err
    assert not (tmp_path / "models").exists() and not (tmp_path / "groups").exists()  # nothing made, nothing started
