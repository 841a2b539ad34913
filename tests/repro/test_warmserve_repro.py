"""`tidal repro warmserve` end to end at a tiny scale: deterministic, a parseable summary line, the files.

The traces are the fixture in tests/repro/data/azure-llm-2023-sample/ (every tenth request of the real
Azure LLM 2023 hours, CC-BY 4.0: Patel et al., Splitwise, ISCA 2024), so the tests run without ../shared.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from loadgen.repro.warmserve import AUTOSCALED, SCALES, SYSTEMS, run_point
from loadgen.repro.warmserve_setup import WORKLOADS
from loadgen.sim.fleet_profile import load_fleet_profile
from tidal.commands import repro_warmserve

SAMPLE = Path(__file__).with_name("data") / "azure-llm-2023-sample"
NUM = r"(\d+\.\d|nan)"
LINE = re.compile(rf"^repro warmserve: p99_ttft_vs_sllm_pool={NUM}x\({NUM}–{NUM}\) "
                  rf"p99_ttft_vs_no_proactive={NUM}x\({NUM}–{NUM}\) p99_ttft_vs_sllm={NUM}x "
                  r"alg1_hit_gain=([+-]\d+%|nan) proactive_hit_gain=([+-]\d+%|nan) seeds=(\d+) "
                  r"within_slo_points=(\d+)/(\d+)$")


def test_tiny_run_prints_the_summary_line_and_writes_the_report(tmp_path, capsys) -> None:
    p = argparse.ArgumentParser()
    repro_warmserve.add_arguments(p)
    args = p.parse_args(["--scale", "tiny", "--out", str(tmp_path), "--azure-dir", str(SAMPLE)])
    assert repro_warmserve.run(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = LINE.match(last)
    assert m, last
    assert int(m.group(10)) == SCALES["tiny"].seeds and int(m.group(12)) == len(SCALES["tiny"].rps)
    if int(m.group(11)):  # SLLM-GPU without an engine pool pays engine creation on every start
        assert float(m.group(7)) > 1.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["line"] == last and "CC-BY 4.0" in summary["trace_attribution"]
    assert {pt["rps"] for pt in summary["points"]} == set(SCALES["tiny"].rps)
    assert len(summary["points"]) == len(SCALES["tiny"].rps) * SCALES["tiny"].seeds  # every seed's point
    assert {pt["seed"] for pt in summary["points"]} == set(range(SCALES["tiny"].seeds))
    for pt in summary["points"]:
        assert set(pt["results"]) == set(SYSTEMS)
        ws = pt["results"]["WarmServe"]
        assert set(ws["starts"]) == {"gpu", "partial", "host", "storage"} and set(ws["per_model"]) == {
            "llama2-7b-0", "llama2-7b-1", "llama2-13b", "llama2-70b"}
    for name in ("report.md", "p99_ttft.png", "prewarm_hit.png", "tpot_cdf.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "50.79x" in report and "SLLM-GPU+pool" in report and "CC-BY 4.0" in report  # beside the paper's numbers
    paper_row = next(r for r in report.splitlines() if "50.79x" in r)
    assert "engine pool" in paper_row and "without" not in paper_row  # the pooled baseline sits beside the paper
    assert "Ablation" in report


def test_the_same_seed_gives_the_same_numbers() -> None:
    cfg = dataclasses.replace(SCALES["tiny"], duration_s=240.0, azure_dir=str(SAMPLE))
    profile = load_fleet_profile(cfg.profile)
    a, b = (run_point(profile, cfg, WORKLOADS["conv-a0.5"], 8.0, only=AUTOSCALED) for _ in range(2))
    for s in AUTOSCALED:
        assert (a.results[s].p99_ttft, a.results[s].starts) == (b.results[s].p99_ttft, b.results[s].starts)
        assert a.results[s].requests == b.results[s].requests > 0


def test_every_autoscaling_system_pays_the_same_start_costs_but_sllm_gpu_creates_engines() -> None:
    cfg = dataclasses.replace(SCALES["tiny"], duration_s=300.0, azure_dir=str(SAMPLE))
    profile = load_fleet_profile(cfg.profile)
    point = run_point(profile, cfg, WORKLOADS["code-a0.5"], 12.0, only=("SLLM-GPU", "SLLM-GPU+pool"))
    bare, pool = point.results["SLLM-GPU"], point.results["SLLM-GPU+pool"]
    assert sum(bare.starts.values()) > 0
    assert bare.p99_ttft > pool.p99_ttft  # the engine pool is the only difference between them


def test_bad_options_are_refused(capsys, tmp_path) -> None:
    p = argparse.ArgumentParser()
    repro_warmserve.add_arguments(p)
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--workloads", "nope"])) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--rps", "5,-1"])) == 2
    assert "--rps" in capsys.readouterr().err
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--azure-dir", str(tmp_path),
                                             "--out", str(tmp_path / "out")])) == 2
    assert "AzureLLMInferenceTrace_conv.csv" in capsys.readouterr().err
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--seeds", "0"])) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err
    changes = repro_warmserve._changes(p.parse_args(["--seeds", "3", "--forecaster", "csp"]))
    cfg = dataclasses.replace(SCALES["paper"], **changes)
    assert (cfg.seeds, cfg.forecaster) == (3, "csp") and SCALES["paper"].seeds == 5


def test_the_paper_protocol_starts_cold_and_warmserve_from_its_preload_round() -> None:
    cfg = dataclasses.replace(SCALES["tiny"], duration_s=240.0, azure_dir=str(SAMPLE))
    assert SCALES["paper"].cold_start and SCALES["paper"].duration_s == 1200.0  # the public generator's 20 minutes
    profile = load_fleet_profile(cfg.profile)
    cold = run_point(profile, cfg, WORKLOADS["conv-a0.5"], 8.0, only=AUTOSCALED)
    warm = run_point(profile, dataclasses.replace(cfg, cold_start=False), WORKLOADS["conv-a0.5"], 8.0,
                     only=AUTOSCALED)
    for s in ("SLLM-GPU", "SLLM-GPU+pool"):  # no free instances: every model's first instance is a start
        assert sum(cold.results[s].starts.values()) >= len(profile.models) > 0
        assert sum(cold.results[s].starts.values()) > sum(warm.results[s].starts.values())
    ws = cold.results["WarmServe"]
    assert ws.prewarms > warm.results["WarmServe"].prewarms  # the pre-load round placed replicas before t = 0
    assert ws.starts["gpu"] >= len(profile.models)  # and the first instances start on them
