"""`tidal repro caraserve --live`'s pieces without a cluster: the trace, the config, the figures,
the summary line, and the simulator's run of the live trace (the live run itself takes minutes)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loadgen.repro.caraserve_live import config_text, simulate
from loadgen.repro.caraserve_live_trace import (
    MODEL, LiveHeadline, LiveSpec, PolicyFigures, adapter_ranks, live_headline, live_trace, parse_line, policy_figures,
)
from loadgen.report.records import RequestRecord
from shared.config import parse_config
from shared.policy.lora_perf_model import LinearFit, LoraPerfModel, LoraPerfProfile
from tidal.cli import main

SPEC = LiveSpec(adapters=12, rate=5.0, duration_s=10.0)


def test_trace_is_seeded_poisson_over_every_rank_with_adapters_named() -> None:
    a, b = live_trace(SPEC), live_trace(SPEC)
    assert a.records == b.records and a.records != live_trace(dataclasses.replace(SPEC, seed=1)).records
    ranks = adapter_ranks(SPEC)
    assert sorted(ranks.values()) == [8] * 3 + [16] * 3 + [32] * 3 + [64] * 3  # equal shares
    assert {i.name: i.rank for i in a.header.adapters} == ranks  # the simulator reads ranks from the header
    arrivals = [r.arrival_s for r in a.records]
    assert arrivals == sorted(arrivals) and 0 < arrivals[-1] < SPEC.duration_s
    assert 25 <= len(a.records) <= 75  # about rate x duration = 50
    for r in a.records:
        assert r.model == MODEL and r.adapter in ranks
        assert SPEC.prompt[0] <= r.prompt_tokens <= SPEC.prompt[1] and SPEC.output[0] <= r.output_tokens <= SPEC.output[1]
    counts = sorted((sum(r.adapter == n for r in a.records) for n in ranks), reverse=True)
    assert counts[0] > counts[-1]  # Zipf: some adapters far more popular


def test_spec_refuses_bad_values() -> None:
    for bad in ({"workers": 0}, {"rate": 0.0}, {"output": (1, 4)}, {"policies": ("most-idle",)},
                {"policies": ("rank-aware", "nope")}):
        with pytest.raises(ValueError):
            LiveSpec(**bad)  # type: ignore[arg-type]


def test_config_per_policy_parses_and_keeps_every_adapter_resident(tmp_path: Path) -> None:
    adapters = {n: (r, tmp_path / n) for n, r in adapter_ranks(SPEC).items()}
    cfg = parse_config(config_text(SPEC, tmp_path, 8123, tmp_path / "model", adapters, "rank-aware",
                                   tmp_path / "profile.json"))
    assert cfg.dispatcher.routing_policy == "rank_aware" and cfg.dispatcher.lora_profile == str(tmp_path / "profile.json")
    assert cfg.policies.lora_kernel == "padded" and cfg.slo.tpot.factor == SPEC.slo_factor
    assert [w.id for w in cfg.workers] == ["cara-0", "cara-1"]
    assert all(set(w.adapters) == set(adapters) for w in cfg.workers)  # Cached: the study isolates routing
    assert {a.name: a.rank for a in cfg.adapters} == {n: r for n, (r, _) in adapters.items()}


def rec(i: int, *, tokens: int = 11, tpot: float = 0.01, status: str = "ok") -> RequestRecord:
    first = 1.0
    return RequestRecord(request_id=f"r{i}", model=MODEL, arrival_s=0.0, prompt_tokens=8, output_tokens=tokens,
                         status=status, first_token_s=first if status == "ok" else None,  # type: ignore[arg-type]
                         finish_s=first + tpot * (tokens - 1))


def test_figures_count_a_failed_request_as_a_miss() -> None:
    records = [rec(0, tpot=0.01), rec(1, tpot=0.02), rec(2, tpot=0.04), rec(3, status="error")]
    f = policy_figures("random", records, slo_s=0.025)
    assert (f.requests, f.ok) == (4, 3)
    assert f.slo_attainment == pytest.approx(0.5)  # 2 of 4 within 25 ms; the error never is
    assert f.tpot_mean_s == pytest.approx(0.07 / 3) and f.tpot_p50_s == pytest.approx(0.02)


def figures(policy: str, tpot: float, slo: float = 0.9) -> PolicyFigures:
    return PolicyFigures(policy=policy, requests=10, ok=10, slo_attainment=slo, tpot_mean_s=tpot, tpot_p50_s=tpot,
                         tpot_p99_s=tpot)


def test_summary_line_and_its_parse() -> None:
    live = {"rank-aware": figures("rank-aware", 0.030, 0.87), "most-idle": figures("most-idle", 0.036),
            "random": figures("random", 0.040), "first-fit": figures("first-fit", 0.050)}
    sim = {"rank-aware": figures("rank-aware", 0.033)}
    head = live_headline(live, sim)
    line = head.line()
    assert line == ("repro caraserve (live): slo_attainment=0.87 tpot_vs_mostidle=-17% tpot_vs_random=-25% "
                    "tpot_vs_firstfit=-40% sim_vs_live_tpot=+10%")
    assert parse_line(line) == LiveHeadline(slo_attainment=0.87, sim_vs_live=0.10,
                                            tpot_vs={"mostidle": -0.17, "random": -0.25, "firstfit": -0.40})
    with pytest.raises(ValueError, match="not a"):
        parse_line("repro caraserve: slo_attainment=0.99 tpot_vs_mostidle=-16%")


def test_simulator_replays_the_live_trace_with_each_policy() -> None:
    decode = LinearFit(alpha_s=30e-6, gamma_s=0.6e-3, beta_s=10e-3)  # about what this host measures (padded)
    prefill = LinearFit(alpha_s=50e-6, gamma_s=0.9e-3, beta_s=-5e-3)  # a negative intercept, as fits give
    lora = LoraPerfProfile(name="t", padded=LoraPerfModel(kernel="padded", decode=decode, prefill=prefill))
    spec = dataclasses.replace(SPEC, rate=8.0)
    slo, out = simulate(spec, live_trace(spec), lora, overhead_s=0.01)
    assert slo == pytest.approx(1.5 * decode.seconds(0, 1))
    assert list(out) == list(spec.policies)
    for f in out.values():
        assert f.ok == f.requests == len(live_trace(spec).records) and f.tpot_mean_s > 0
    assert out["rank-aware"].tpot_mean_s <= out["first-fit"].tpot_mean_s  # FirstFit piles onto one worker


def test_cli_refuses_a_missing_profile(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["repro", "caraserve", "--live", "--profile", str(tmp_path / "none.json")]) == 2
    assert "--profile" in capsys.readouterr().err
