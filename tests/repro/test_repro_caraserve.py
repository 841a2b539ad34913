"""`tidal repro caraserve` at tiny scale: deterministic, a parseable summary line, rank-aware's edge."""
from __future__ import annotations

import dataclasses
import json
import re

from loadgen.repro.caraserve import SCALES, build_trace, headline, run_repro
from loadgen.sim.lora_worker import LoraSimWorker
from loadgen.sim.profile import load_profile
from shared.lora_profile_file import load_lora_profile
from loadgen.repro.caraserve import LORA_PROFILE
from tidal.cli import main

LINE = re.compile(r"^repro caraserve: cold_ttft_overhead_caraserve=(?P<cara>-?\d+)% "
                  r"cold_ttft_overhead_async=(-?\d+)% cold_ttft_overhead_ondemand=(?P<ond>-?\d+)% "
                  r"cold_ttft_overhead_slora=(-?\d+)% cpu_assisted_share=(?P<share>\d+)% seeds=(?P<seeds>\d+) "
                  r"slo_attainment=(\d\.\d\d) tpot_vs_mostidle=([+-]\d+)% "
                  r"tpot_vs_random=([+-]\d+)% tpot_vs_firstfit=([+-]\d+)%$")


def test_cli_tiny_writes_report_and_ends_with_summary_line(tmp_path, capsys):
    assert main(["repro", "caraserve", "--scale", "tiny", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = LINE.match(last)
    assert m, last
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["line"] == last
    assert (tmp_path / "report.md").read_text().startswith("# CaraServe")
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "slo_attainment.png", "tpot_mean.png", "tpot_cdf.png", "cold_fig10_cdf.png", "cold_fig11_iterations.png",
        "cold_overheads_pcie-peak.png", "cold_overheads_paper-effective.png"}
    assert {r["workload"] for r in summary["cold_start"]["runs"]} >= {"synthetic-r64", "maf-512"}
    assert int(m["seeds"]) >= 3 and int(m["share"]) >= 90  # the loads start with the CPU prefill: it does the work
    assert int(m["ond"]) >= 10 and abs(int(m["cara"])) < int(m["ond"]) / 3  # CaraServe below a third of OnDemand


def test_tiny_run_is_deterministic():
    cfg = dataclasses.replace(SCALES["tiny"], kernels=("padded",), policies=("rank-aware", "random"), cold_workloads=())
    a, b = run_repro(cfg), run_repro(cfg)
    assert headline(a).line() == headline(b).line()
    assert a.results[("padded", "random")].tpots == b.results[("padded", "random")].tpots


def test_rank_aware_meets_the_slo_at_least_as_often_as_random_and_first_fit():
    cfg = dataclasses.replace(SCALES["tiny"], kernels=("padded",), policies=("rank-aware", "random", "first-fit"),
                              cold_workloads=())
    run = run_repro(cfg)
    ra = run.results[("padded", "rank-aware")]
    assert ra.slo_attainment >= run.results[("padded", "random")].slo_attainment
    assert ra.slo_attainment > run.results[("padded", "first-fit")].slo_attainment
    assert ra.tpot_mean_s < run.results[("padded", "first-fit")].tpot_mean_s


def test_step_time_is_the_routers_linear_model():
    lora = load_lora_profile(LORA_PROFILE).model("padded")
    profile = load_profile("a10-llama2-7b-lora")
    trace = build_trace(SCALES["tiny"])
    ranks = {a.name: a.rank for a in trace.header.adapters}
    w = LoraSimWorker(0, "w0", "m", profile.worker, profile.step, 0.5, lora=lora, ranks=ranks)
    assert w.extra_step_s(()) == 0.0  # an empty batch pays nothing
    rec = trace.records[0]
    from loadgen.sim.request import SimRequest

    req = SimRequest(0, "r", rec.model, rec.adapter, 0.0, rec.prompt_tokens, 4)
    assert w.enqueue(req, 0.0) is not None  # prefill step planned
    w.complete(w.run_start + 1.0)
    assert w.extra_step_s(()) == lora.decode_s([ranks[rec.adapter]])
