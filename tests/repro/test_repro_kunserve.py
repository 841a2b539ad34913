"""`tidal repro kunserve` at tiny scale: deterministic, a parseable summary line, buddy groups help a
memory-bound spike; the operating point is Llumnix's (in-process + head-of-line demand); and moving
requests between simulated workers keeps their progress exactly."""
from __future__ import annotations

import dataclasses
import json
import re

from loadgen.repro.kunserve import (
    HARNESS, SCALES, build_trace, harness_profile, mean_demand, operating_rate, pipeline_profile, run_repro, simulate,
)
from loadgen.repro.kunserve_regime import headline
from loadgen.sim.pipeline import put_all, settle, take_all
from loadgen.sim.profile import load_profile
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker
from tidal.cli import main

LINE = re.compile(r"^repro kunserve: p99_ttft_vs_replication=\d+\.\dx p99_ttft_vs_migration=\d+\.\dx "
                  r"p50_tbt_vs_replication=\d+\.\dx regime_match=\d+/\d+ slo_violation_replication=\d+% "
                  r"slo_violation_kunserve=\d+% kv_load_before_burst=\d+% seeds=\d+$")


def test_cli_tiny_writes_report_and_ends_with_summary_line(tmp_path, capsys):
    assert main(["repro", "kunserve", "--scale", "tiny", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert LINE.match(last), last
    assert json.loads((tmp_path / "summary.json").read_text())["line"] == last
    assert (tmp_path / "fig16_ablation.png").exists() and (tmp_path / "fig10_ttft_p99.png").exists()
    assert (tmp_path / "kv_occupancy.png").exists() and (tmp_path / "waiting_split.png").exists()
    report = (tmp_path / "report.md").read_text()
    assert "Regime check" in report and "vllm-0.6" in report and "MISMATCH" in report  # tiny sits below the band


def test_tiny_is_deterministic_and_kunserve_cuts_the_tail_of_a_memory_bound_spike():
    cfg = dataclasses.replace(SCALES["tiny"], systems=("replication", "kunserve"), ablation=False)
    a, b = run_repro(cfg), run_repro(cfg)
    assert headline(a).line() == headline(b).line()
    dataset, = cfg.datasets
    rate = a.rates[dataset][0]
    kun, rep = a.get(dataset, rate, "kunserve"), a.get(dataset, rate, "replication")
    assert kun.drops >= 1  # the spike throttled KV and the monitor dropped layers
    assert kun.ttft_p99 < rep.ttft_p99 and kun.preemptions < rep.preemptions
    assert kun.requests == rep.requests
    assert rep.kv_peak > 0.99 and rep.preemptions > 0  # the baseline runs out of KV and recomputes
    assert 0.3 < rep.kv_before < 0.7  # the long-lived base holds KV near half full before the spikes


def test_the_operating_point_puts_mean_head_of_line_demand_at_the_papers_memory_level():
    # KunServe §2.2: KV provisioned at 2.1x the mean demand (in-process + head-of-line queued, Llumnix's)
    cfg = dataclasses.replace(SCALES["tiny"], systems=("replication",), ablation=False)
    dataset, = cfg.datasets
    rate = operating_rate(cfg, dataset)
    _, at = simulate(cfg, build_trace(cfg, dataset, rate), "replication")
    assert abs(mean_demand(cfg, at) - 1 / 2.1) < 0.05
    _, low = simulate(cfg, build_trace(cfg, dataset, rate / 2), "replication")
    assert mean_demand(cfg, low) < 1 / 2.1 - 0.1
    # the head-of-line demand never exceeds the all-queued demand Llumnix's rule replaced
    assert all(s.demand_hol <= s.demand + 1e-9 for s in at.samples)


def test_the_engine_is_kunserves_harness_and_groups_stop_at_two_stages():
    cfg = SCALES["paper"]
    spec = harness_profile(cfg).worker
    assert (spec.max_batch, spec.max_batched_tokens, spec.block_size) == (256, 131072, 256)
    assert abs(spec.kv_blocks * spec.block_size * spec.kv_bytes_per_token - 33e9) < spec.block_size * spec.kv_bytes_per_token
    assert spec.engine_mode == "vllm-0.6" and HARNESS["kv_blocks"] == spec.kv_blocks
    assert pipeline_profile(cfg).max_stages == 2  # the published efficiencies cover 2 stages


def test_every_request_finishes_once_with_all_its_tokens_through_drops_and_restores():
    cfg = SCALES["tiny"]
    dataset, = cfg.datasets
    reqs, cluster = simulate(cfg, build_trace(cfg, dataset, cfg.rate_steps[0] * operating_rate(cfg, dataset)), "kunserve")
    assert cluster.drops >= 1 and cluster.restores >= 1
    assert all(r.status == "ok" and r.first_token >= r.arrival and r.finish >= r.first_token for r in reqs)
    assert all(r.generated == r.output for r in reqs)


def test_moving_requests_between_workers_keeps_context_and_blocks():
    profile = load_profile("a800-qwen2.5-14b")
    src = SimWorker(0, "a", "m", profile.worker, profile.step, 0.5)
    dst = SimWorker(1, "b", "m", profile.worker, profile.step, 0.5)
    reqs = [SimRequest(i, f"r{i}", "m", None, 0.0, 100 + 10 * i, 50) for i in range(3)]
    end = None
    for r in reqs:
        end = src.enqueue(r, 0.0) or end
    src.complete(end)  # prefill done: all three decode
    src.plan(end)
    settle(src, end + 0.05)
    ctx_before = src.ctx_sum
    moved = take_all(src)
    assert src.used == 0 and src.decoding == 0
    put_all(dst, moved)
    assert dst.ctx_sum == ctx_before and dst.decoding == 3
    dst.check()  # the recount from scratch agrees with the moved counters


def test_cli_refuses_unknown_systems_and_a_burst_below_one(tmp_path, capsys):
    assert main(["repro", "kunserve", "--scale", "tiny", "--systems", "replication,vllm", "--out", str(tmp_path)]) == 2
    assert "unknown vllm" in capsys.readouterr().err
    assert main(["repro", "kunserve", "--scale", "tiny", "--burst-magnitude", "0.5", "--out", str(tmp_path)]) == 2
    assert "--burst-magnitude must be >= 1" in capsys.readouterr().err
    assert main(["repro", "kunserve", "--scale", "tiny", "--trace", str(tmp_path / "none.jsonl"),
                 "--out", str(tmp_path)]) == 2
    assert "--trace" in capsys.readouterr().err


def test_cli_replays_a_burstgpt_segment_through_the_same_bins(tmp_path, capsys):
    from loadgen.traces.io import write_trace
    from loadgen.traces.schema import BurstGPTParams, Trace, TraceHeader, TraceRecord

    # a segment as `tidal trace burstgpt --csv CSV --kunserve-segment` writes it (timestamps already / 10)
    times = [1000.2] * 3 + [1003.5] * 40 + [1004.1] * 40 + [1010.0] * 2
    records = [TraceRecord(arrival_s=t, model="m", prompt_tokens=400, output_tokens=200, request_id=f"r{i}")
               for i, t in enumerate(times)]
    seg = tmp_path / "segment.jsonl"
    write_trace(seg, Trace(header=TraceHeader(params=BurstGPTParams(), num_records=len(records), duration_s=10.0),
                           records=records))
    out = tmp_path / "out"
    assert main(["repro", "kunserve", "--scale", "tiny", "--trace", str(seg), "--systems", "replication,migration,kunserve",
                 "--no-ablation", "--no-plots", "--out", str(out)]) == 0
    assert LINE.match(capsys.readouterr().out.strip().splitlines()[-1])
    assert "a real BurstGPT segment's 1-s bins" in (out / "report.md").read_text()
