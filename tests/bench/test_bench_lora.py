"""`tidal bench lora`: its pure parts (pacing, workloads, trace, paired overheads, summary, the core
split) and a tiny real run."""
from __future__ import annotations

import re
import subprocess
import json
import sys
from pathlib import Path

import pytest

from tidal.bench.lora_drive import split_cores
from tidal.bench.lora_drive import base_mode, baseline_of
from tidal.bench.lora_stats import (CPU_RATIOS, PAPER_LOAD_OVER_PREFILL, PAPER_TYPICAL_PREFILL_S, WORKLOADS, cpu_pace,
                                    make_trace, paced_bandwidth, paired_overhead, round_overheads, scaled_rate,
                                    summary_line)

ARM = r"(-?\d+)%\[(-?\d+)\.\.(-?\d+)\]"
SUMMARY = re.compile(rf"^bench lora: ttft_overhead_cpu_assist={ARM} ttft_overhead_async={ARM} ttft_overhead_auto={ARM} "
                     rf"ttft_overhead_ondemand={ARM} ttft_overhead_slora={ARM} rounds=(\d+) cpu_ratio=([\d.]+) "
                     r"auto_choices=cpu_assist:(\d+),async:(\d+),inline:(\d+)$")


def test_pacing_gives_a_rank64_load_the_papers_share_of_a_prefill():
    bw = paced_bandwidth(1_000_000, 0.010)
    assert 1_000_000 / bw == pytest.approx(PAPER_LOAD_OVER_PREFILL * 0.010)
    assert PAPER_LOAD_OVER_PREFILL == pytest.approx(16.7 / 32, rel=0.01)
    with pytest.raises(ValueError, match="prefill_s"):
        paced_bandwidth(1_000_000, 0.0)


def test_trace_marks_each_adapters_first_request_cold_and_reuses_warm():
    trace = make_trace(200, 5.0, (8, 16), 100, reuse=0.3, seed=1)
    assert trace == make_trace(200, 5.0, (8, 16), 100, reuse=0.3, seed=1)  # same seed, same requests
    seen: set[int] = set()
    for r in trace:
        assert r.cold == (r.slot not in seen)
        seen.add(r.slot)
    warm = sum(not r.cold for r in trace)
    assert 30 < warm < 90 and all(r.cold for r in make_trace(20, 5.0, (8, 16), 100, reuse=0.0, seed=1))
    with pytest.raises(ValueError, match="reuse"):
        make_trace(5, 1.0, (8, 16), 100, reuse=1.5, seed=0)


def test_workloads_are_the_papers_and_rates_scale_with_the_prefill():
    w = WORKLOADS["synthetic-r64"]
    assert (w.ranks, w.paper_rps, w.cold_fraction) == ((64,), 9.0, 1.0)
    assert WORKLOADS["synthetic-r32"].ranks == (32,) and WORKLOADS["synthetic-r64-6rps"].paper_rps == 6.0
    assert [WORKLOADS[f"maf-{n}"].paper_rps for n in (128, 256, 512)] == [1.5, 3.6, 7.7]
    assert scaled_rate(9.0, PAPER_TYPICAL_PREFILL_S) == pytest.approx(9.0)
    assert scaled_rate(9.0, 2 * PAPER_TYPICAL_PREFILL_S) == pytest.approx(4.5)  # half the capacity, half the rate


def test_trace_ranks_popularity_and_bursts():
    trace = make_trace(400, 5.0, (8, 16), 100, reuse=0.0, seed=2, ranks=(32, 64))
    assert {r.rank for r in trace} == {32, 64} and all(r.cold for r in trace)
    maf = make_trace(400, 5.0, (8, 16), 100, reuse=0.0, seed=2, adapters=64, cv=2.0)
    slots = [r.slot for r in maf]
    assert slots.count(0) > slots.count(10) > 0  # Zipf: the first adapter is the most popular
    assert sum(r.cold for r in maf) == len(set(slots))
    gaps = [b.at_s - a.at_s for a, b in zip(maf, maf[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 1.5 < cv < 2.6 and 0.15 < mean < 0.25  # bursty around the same rate


def test_helpers_get_cores_of_their_own_where_there_are_some():
    assert split_cores((0,)).helpers == ()  # one core: nothing pinned
    two = split_cores((0, 1))
    assert two.engine == (0,) and two.helpers == (1,)
    sixteen = split_cores(tuple(range(16)), 4)
    assert sixteen.helpers == (12, 13, 14, 15) and len(sixteen.engine) == 12
    assert "of their own" in sixteen.describe()


def _rows(ttfts: list[float], cold: list[bool]) -> list[dict]:
    return [{"ttft_s": t, "tpot_s": 0.01, "e2e_s": t + 0.1, "cold": c} for t, c in zip(ttfts, cold)]


def test_overheads_pair_the_same_requests_under_cached():
    cold = [True, True, False]
    base = _rows([0.1, 0.1, 0.2], cold)
    ondemand = _rows([0.4, 0.2, 0.2], cold)
    assert paired_overhead(ondemand, base, "ttft_s", "cold") == pytest.approx(2.0)  # 0.6 / 0.2 - 1
    assert paired_overhead(ondemand, base, "ttft_s", "warm") == pytest.approx(0.0)
    assert paired_overhead(ondemand, base, "ttft_s", "all", "mean") == pytest.approx(0.8 / 0.4 - 1)
    assert paired_overhead(_rows([0.1, 0.5, 0.3], cold), base, "ttft_s", "all") == pytest.approx(0.3 / 0.1 - 1)  # medians
    rounds = [{"cached": base, "ondemand": ondemand}, {"cached": base, "ondemand": _rows([0.15, 0.15, 0.2], cold)},
              {"cached": base, "ondemand": _rows([0.3, 0.3, 0.2], cold)}]
    over = round_overheads(rounds, ["cached", "ondemand"])
    assert over["ondemand"]["ttft_s_cold"] == pytest.approx([2.0, 0.5, 2.0])
    assert summary_line(over) == ("bench lora: ttft_overhead_cpu_assist=n/a ttft_overhead_async=n/a "
                                  "ttft_overhead_auto=n/a ttft_overhead_ondemand=200%[50..200] "
                                  "ttft_overhead_slora=n/a rounds=3")
    # each mode against the Cached on its own kernel
    slow = _rows([0.3, 0.3, 0.2], cold)
    rec = {"cached": base, "cached_bgmv": _rows([0.15, 0.15, 0.2], cold), "ondemand": slow}
    modes = ["cached", "cached_bgmv", "ondemand"]
    baselines = {m: baseline_of(m, modes, "segmented") for m in ("ondemand",)}
    assert baselines == {"ondemand": "cached_bgmv"}
    over = round_overheads([rec], modes, baselines=baselines)
    assert over["ondemand"]["ttft_s_cold"] == pytest.approx([1.0]) and "cached_bgmv" not in over
    assert baseline_of("slora", modes, "segmented") == "cached"  # MBGMV = segmented: cached is on it
    assert baseline_of("slora", modes, "padded") is None  # no Cached on MBGMV ran


def test_cpu_ratio_is_the_papers_and_the_pace_gives_it():
    assert CPU_RATIOS == (0.28, 1.77)  # bf16 / fp32 on 8 cores, 128 tokens rank 64 against 32 ms
    pace = cpu_pace(1.77, 0.010, 128, 64, 4, 1)  # 4 helper calls a step, one helper
    assert 4 * 128 * 64 * pace == pytest.approx(1.77 * 0.010)
    assert cpu_pace(1.77, 0.010, 128, 64, 4, 2) == pytest.approx(2 * pace)  # rows split over two helpers
    with pytest.raises(ValueError):
        cpu_pace(0.0, 0.010, 128, 64, 4, 1)
    assert base_mode("auto@1.77") == "auto" and base_mode("cached_bgmv") == "cached_bgmv"
    for bad in ("slora@1.0", "auto@x", "auto@-1", "turbo"):
        with pytest.raises(ValueError):
            base_mode(bad)


def test_tiny_bench_run_ends_with_its_summary_line(tmp_path: Path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "bench", "lora", "--requests", "3", "--prompt-len", "16", "48",
         "--output-len", "3", "--rounds", "1", "--layers", "2", "--hidden", "128", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert SUMMARY.match(last), last
    assert "(derived)" in proc.stdout and "cores: " in proc.stdout and "workload synthetic-r64" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert set(res["rounds"][0]) == {"cached", "cached_bgmv", "ondemand", "slora", "async", "cpu_assist@0.28",
                                     "cpu_assist@1.77", "auto@0.28", "auto@1.77"}
    kernels = res["kernels"]
    assert kernels["slora"] == kernels["cached"] == "segmented" != kernels["ondemand"] == kernels["cached_bgmv"]
    assert res["baselines"]["ondemand"] == "cached_bgmv" and res["baselines"]["slora"] == "cached"
    assert res["cpu_paces"]["cpu_assist@1.77"] == pytest.approx(res["cpu_paces"]["cpu_assist@0.28"] * 1.77 / 0.28)
    m = SUMMARY.match(last)
    rule = res["decision_rule"]["auto@0.28"]
    assert [int(m[i]) for i in (18, 19, 20)] == [rule["choices"][k] for k in ("cpu_assist", "async", "inline")]
    assert sum(rule["choices"].values()) >= 3 and rule["t_cpu_s"] is not None  # every cold request decided; measured
    assert "the rule chose" in proc.stdout
    assert all(r["cold"] and r["rank"] == 64 for r in res["rounds"][0]["cached"])
    counters = res["engine_counters"]
    assert counters["ondemand"]["inline_loads"] >= 3 and counters["async"]["inline_loads"] == 0
    assert counters["cpu_assist@0.28"]["cpu_chunks"] >= 1 and counters["cpu_assist@0.28"]["fallbacks"] == 0
