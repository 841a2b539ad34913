"""The KV-packing simulation and `tidal repro mell`: KV arithmetic of the paper's models, the
op stream, fragmentation, determinism and the summary line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from loadgen.repro.mell_footprint import final_sizes, reserved_bytes
from loadgen.repro.mell_setup import GIB, LLAMA2_7B, LLAMA2_13B, TESTBEDS
from loadgen.sim.kv_packing import build_schedule, run_policy, utilisation
from shared.policy.binpack_baselines import BestFitRestart, BestFitReserve, WorstFitReserve
from shared.policy.mell import MellScheduler
from shared.policy.mell_ops import Allocate, Depart, Update
from tidal.cli import main

SUMMARY = re.compile(r"^repro mell: gpus_vs_bf=[+-]\d+% gpus_vs_wf=[+-]\d+% gpus_vs_lb=[+-]\d+% "
                     r"gpus_ours_vs_best_baseline=[+-]\d+% batching_cut=[+-]\d+% max_items_per_op=\d+ "
                     r"max_requests_per_op=\d+ moves_per_request=\d+\.\d gpus_vs_lower_bound=[+-]\d+%$")
AZURE_EXCERPT = str(Path(__file__).parent / "data" / "azure-llm-2023")


def test_kv_bytes_per_token_of_the_papers_models() -> None:
    assert LLAMA2_7B.kv_bytes_per_token() == 32 * 32 * 128 * 2 * 2 == 524_288
    assert LLAMA2_13B.kv_bytes_per_token() == 40 * 40 * 128 * 2 * 2 == 819_200
    # MELL §III: a 4096-token request on LLaMA-13B holds "about 3.2 GB" of KV
    assert 3.2e9 < 4096 * LLAMA2_13B.kv_bytes_per_token() < 3.5e9
    assert TESTBEDS["7b-4090"].capacity() == 24 * GIB - 6_738_415_616 * 2
    assert TESTBEDS["13b-a100"].capacity() == 40 * GIB - 13_015_864_320 * 2
    for tb in TESTBEDS.values():  # the cited cost profiles agree with the configs
        assert tb.profile().worker.kv_bytes_per_token == tb.model.kv_bytes_per_token()
        assert 0.01 < tb.decode_step_s(0.75) < 0.05


def test_one_request_becomes_allocate_grow_depart_at_epoch_boundaries() -> None:
    s = build_schedule(np.array([0.5]), np.array([10]), np.array([5]), capacity=100, bytes_per_token=1,
                       granule_tokens=4, epoch_s=1.0, prefill_s_per_token=0.0, decode_step_s=1.0)
    # tokens at boundaries 1..4: 11, 12, 13, 14 -> reserved 12, 12, 16, 16; done at 4.5
    assert s.epochs[1] == [Allocate("r0", 12)]
    assert s.epochs[3] == [Update("r0", 16)]
    assert s.epochs[5] == [Depart("r0")]
    assert [len(e) for e in s.epochs] == [0, 1, 0, 1, 0, 1]
    assert s.used_bytes.tolist() == [0, 12, 12, 16, 16, 0]


def test_requests_longer_than_a_device_are_clipped_and_counted() -> None:
    s = build_schedule(np.array([0.1, 0.2]), np.array([500, 10]), np.array([50, 5]), capacity=100,
                       bytes_per_token=1, granule_tokens=1, epoch_s=1.0, prefill_s_per_token=0.0,
                       decode_step_s=0.5)
    assert s.truncated == 1
    assert max(op.size for ops in s.epochs for op in ops if not isinstance(op, Depart)) == 100


def fragmenting_trace():
    """Four large requests with a small one beside each; the large ones leave at once, which
    strands the small ones one per device unless they are consolidated."""
    arrival = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    prompt = np.array([59] * 4 + [19] * 4)
    output = np.array([1] * 4 + [2] * 4)
    return build_schedule(arrival, prompt, output, capacity=1000, bytes_per_token=10, granule_tokens=1,
                          epoch_s=1.0, prefill_s_per_token=0.0, decode_step_s=100.0)


def test_mell_uses_no_more_gpus_than_worst_fit_on_a_fragmenting_trace() -> None:
    s = fragmenting_trace()
    wf = run_policy(s, WorstFitReserve(1000, final_size=final_sizes(s)), "WF")
    mell = run_policy(s, MellScheduler(1000), "MELL")
    assert np.all(mell.active <= wf.active)
    assert wf.active[10] == 4 and mell.active[10] < 4
    assert mell.mean_devices() < wf.mean_devices()
    assert utilisation(s, mell) > utilisation(s, wf)
    assert wf.moves == 0 and mell.moves > 0
    assert wf.overcommitted_epochs == mell.overcommitted_epochs == 0


def test_reserving_the_final_size_costs_bf_and_wf_a_gpu_that_mell_does_not_need() -> None:
    """r0 grows 31 -> 59, r1 (arriving at 20 s) 21 -> 44: at most 88 B in use at once, but the
    two footprints (103 B) do not fit one 100 B GPU, so the hindsight arms, which reserve them, open a second."""
    s = build_schedule(np.array([0.1, 20.1]), np.array([30, 20]), np.array([30, 25]), capacity=100,
                       bytes_per_token=1, granule_tokens=1, epoch_s=1.0, prefill_s_per_token=0.0, decode_step_s=1.0)
    final = final_sizes(s)
    assert final == {"r0": 59, "r1": 44}
    held = reserved_bytes(s, final)
    assert held.max() == 103 and s.used_bytes.max() == 88 and held[-1] == 0
    assert np.all(held >= s.used_bytes)
    for policy in (BestFitReserve(100, final_size=final), WorstFitReserve(100, final_size=final)):
        r = run_policy(s, policy, policy.name)
        assert r.peak_devices() == 2 and r.moves == 0 and r.overcommitted_epochs == 0
    for policy in (MellScheduler(100), BestFitRestart(100)):
        r = run_policy(s, policy, "x")
        assert r.peak_devices() == 1 and r.overcommitted_epochs == 0


def run_tiny(tmp_path, capsys, name: str, *extra: str) -> tuple[str, dict]:
    out = tmp_path / name
    assert main(["repro", "mell", "--scale", "tiny", "--out", str(out), "--azure-dir", AZURE_EXCERPT, *extra]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines[-1], json.loads((out / "summary.json").read_text())


def _figures(summary: dict) -> list:
    return [{p: {k: v for k, v in r.items() if k != "wall_s"} for p, r in sc["policies"].items()}
            for sc in summary["scenarios"]]


@pytest.mark.timeout(900)  # three tiny repros, each arm's pool searched at the SLO
def test_tiny_repro_is_deterministic_and_ends_with_the_summary_line(tmp_path, capsys) -> None:
    line, first = run_tiny(tmp_path, capsys, "a", "--testbeds", "7b-4090")
    assert SUMMARY.match(line), line
    assert first["headline"] == line
    report = (tmp_path / "a" / "report.md").read_text()
    assert "## Paper vs ours" in report and report.rstrip().endswith(line)
    for section in ("## What waiting costs", "## What the moves cost", "## Planning interval (MELL)",
                    "## Extra arms: BF/WF reserving the final size (hindsight)", "## What each arm cost to run",
                    "CC-BY 4.0"):
        assert section in report, section
    sc = {s["workload"]: s for s in first["scenarios"]}
    assert set(sc) == {"poisson-1.1", "azure-conv"}
    for s in sc.values():
        policies = s["policies"]
        assert {"BF", "WF", "LB", "BF-restart", "WF-restart", "LB-open", "MELL", "Ours", "MELL-uncapped",
                "MELL-free", "BF-reserve", "WF-reserve"} == policies.keys()
        assert s["lower_bound_l2"] >= s["lower_bound_l1"] >= 1
        assert set(s["wall_s_per_arm"]) >= set(policies)  # what each arm cost (its run + its pool search)
        assert policies["MELL"]["peak_gpus"] >= s["lower_bound_l2"]  # MELL delays nobody for long
        for p in ("BF", "WF", "BF-reserve", "WF-reserve"):  # they never migrate
            assert policies[p]["migrations"] == 0, p
        for p in ("LB", "MELL"):  # migrations are charged: pre-copy time, stalls
            assert policies[p]["move_costs"]["kv_ok"] > 0 and policies[p]["move_costs"]["copy_s"] > 0
        assert policies["MELL"]["token_migrations"] > 0  # adaptive migration: both kinds happen
        assert policies["MELL-uncapped"]["max_moves_per_op"] >= policies["MELL-uncapped"]["max_items_per_op"] >= 1
        # every arm that meets the SLO on demand has a pool that meets it, no larger than its on-demand peak + 1
        for arm, got in s["gpus_at_slo"].items():
            if got["gpus"] is not None:
                assert got["tried"][str(got["gpus"])], arm
                assert got["gpus"] == 1 or got["tried"][str(got["gpus"] - 1)] is False, arm  # the next pool down misses
                assert got["gpus"] <= policies[arm]["peak_gpus_with_copies"] + 1, arm
        assert s["gpus_at_slo"]["BF"]["gpus"] is None  # BF's preemptions cost more TPOT than the SLO allows
        assert policies["BF-reserve"]["held"] > policies["BF-reserve"]["util"]  # reserved is not in use
        assert policies["BF"]["preemptions"] > 0  # BF admits on what it knows; its engine preempts the growth
    assert [sw["epoch_s"] for sw in sc["poisson-1.1"]["sweep"]] == [1.0, 5.0]
    assert (tmp_path / "a" / "fig11_gpus.png").stat().st_size > 0
    line2, second = run_tiny(tmp_path, capsys, "b", "--testbeds", "7b-4090", "--no-plots", "--jobs", "1")
    assert line2 == line and _figures(second) == _figures(first)
    _, other = run_tiny(tmp_path, capsys, "c", "--testbeds", "7b-4090", "--no-plots", "--seed", "7",
                        "--workloads", "poisson-1.1")
    assert _figures(other) != _figures(first)[:1]


def test_unknown_workload_is_refused_by_name(capsys) -> None:
    assert main(["repro", "mell", "--workloads", "poisson-9"]) == 2
    assert "unknown workload ['poisson-9']" in capsys.readouterr().err


def test_a_missing_azure_trace_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["repro", "mell", "--scale", "tiny", "--workloads", "azure-code", "--azure-dir", str(tmp_path),
                 "--no-plots", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "AzureLLMInferenceTrace_code.csv" in err and "is missing" in err and "--azure-dir" in err
