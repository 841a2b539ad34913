"""MELL through the planner core in the KV-packing simulation (loadgen/sim/kv_packing_core.py): the
simulator feeds PlannerCore + MellPolicy views of its devices, applies the migrations and routes
arrivals by the placement hints; its GPU counts agree with MellScheduler called directly."""
from __future__ import annotations

import dataclasses

import numpy as np
from repro.test_kv_packing import AZURE_EXCERPT, fragmenting_trace

from loadgen.repro.mell import SCALES, build_scenario, make_policy
from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS
from loadgen.sim.kv_packing import run_policy
from loadgen.sim.kv_packing_core import device_count, run_core
from shared.policy.mell import MellScheduler
from tidal.cli import main


def test_the_core_path_consolidates_a_fragmenting_trace_as_mell_does() -> None:
    s = fragmenting_trace()
    direct = run_policy(s, MellScheduler(1000), "MELL")
    core = run_core(s)
    assert core.active.tolist() == direct.active.tolist()
    assert core.active[10] < 4 and core.overcommitted_epochs == 0  # the KV books are checked every epoch
    # all eight arrive in one interval: the first follows the hint, the rest find the hinted device full
    assert sum(core.routes.values()) == 8 and core.routes["hinted"] >= 1 and core.devices == device_count(s)


def small(testbed: str, workload: str, seed: int = 0):
    cfg = dataclasses.replace(SCALES["tiny"], poisson_duration_s=150.0, azure_duration_s=150.0, seed=seed,
                              azure_dir=AZURE_EXCERPT)
    sc = build_scenario(TESTBEDS[testbed], WORKLOADS[workload], cfg)
    return sc.schedule, run_policy(sc.schedule, make_policy("MELL-direct", sc.schedule.capacity, cfg), "direct")


def test_the_core_paths_gpu_counts_match_the_direct_paths_at_small_scale() -> None:
    for testbed, workload in (("7b-4090", "poisson-1.1"), ("13b-a100", "azure-conv")):
        schedule, direct = small(testbed, workload)
        core = run_core(schedule)
        assert abs(core.peak_devices() - direct.peak_devices()) <= 1, (testbed, workload)
        assert abs(core.mean_devices() - direct.mean_devices()) <= 0.05 * direct.mean_devices()
        assert core.overcommitted_epochs == 0
        arrivals = sum(core.routes.values())
        assert arrivals == schedule.requests
        # most arrivals go where MELL allocates them; an interval of the real Azure trace (5.5 requests/s)
        # holds several arrivals, and the hints name one device per KV class: a second arrival of the class
        # may find it full (routed by load instead) or be moved afterwards
        assert core.routes["hinted"] >= 0.8 * arrivals
        assert core.misroutes <= 0.3 * arrivals


def test_hints_save_the_migrations_least_load_routing_makes_mell_do() -> None:
    schedule, _ = small("7b-4090", "poisson-1.1", seed=3)
    hinted, blind = run_core(schedule), run_core(schedule, hints=False)
    assert blind.routes == {"no_hint": schedule.requests}
    assert hinted.misroutes * 3 < blind.misroutes  # without hints MELL moves most arrivals after the fact
    assert hinted.moves < blind.moves
    assert np.abs(hinted.active - blind.active).max() <= 2  # the same MELL placement either way, give or take


def test_repro_reports_the_core_path_beside_the_fleet_with_core(tmp_path, capsys) -> None:
    out = tmp_path / "r"
    assert main(["repro", "mell", "--scale", "tiny", "--testbeds", "7b-4090", "--workloads", "poisson-1.1",
                 "--intervals", "", "--core", "--no-plots", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "## MELL through the planner core (undelayed op stream) vs the fleet" in report
    assert "MELL-core" in capsys.readouterr().out
    summary = (out / "summary.json").read_text()
    assert '"MELL-core"' in summary and '"sweep": []' not in summary  # the 1 s run is the sweep's only point
