"""`tidal bench lora`: its pure parts (pacing, trace, paired overheads, summary) and a tiny real run."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tidal.bench.lora_stats import (PAPER_LOAD_OVER_PREFILL, make_trace, paced_bandwidth, paired_overhead,
                                    round_overheads, summary_line)

SUMMARY = re.compile(r"^bench lora: ttft_overhead_cpu_assist=(-?\d+)% ttft_overhead_ondemand=(-?\d+)% "
                     r"ttft_overhead_slora=(-?\d+)%$")


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
    with pytest.raises(ValueError, match="--reuse"):
        make_trace(5, 1.0, (8, 16), 100, reuse=1.0, seed=0)


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
    assert summary_line(over) == ("bench lora: ttft_overhead_cpu_assist=n/a ttft_overhead_ondemand=200% "
                                  "ttft_overhead_slora=n/a")


def test_tiny_bench_run_ends_with_its_summary_line(tmp_path: Path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "bench", "lora", "--requests", "4", "--rps", "4", "--prompt-len", "16", "32",
         "--output-len", "3", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert SUMMARY.match(last), last
    assert "lora_load_bandwidth = " in proc.stdout and "(derived)" in proc.stdout
    cfg = tomllib.loads((out / "cluster" / "cluster.toml").read_text())
    assert cfg["policies"]["lora_kernel"] == "segmented"  # one kernel for every mode
    workers = {w["id"]: w for w in cfg["workers"]}
    assert len(workers) == 4 and len({w["lora_load_bandwidth"] for w in workers.values()}) == 1
    assert workers["lora-cpu-assist"]["cpu_lora_processes"] == 2 and workers["lora-ondemand"]["cpu_lora_processes"] == 0
    assert workers["lora-cached"]["adapters"] and not workers["lora-ondemand"]["adapters"]
    assert (out / "results.json").is_file()
