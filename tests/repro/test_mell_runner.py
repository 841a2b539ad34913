"""`tidal repro mell`'s runner (loadgen/repro/mell_runner.py): the arms of every scenario as tasks over
processes give the results one process gives, assembled per scenario in the arms' order."""
from __future__ import annotations

import dataclasses

from loadgen.repro.mell import POLICIES, SCALES, build_scenario, headline, run_scenario
from loadgen.repro.mell_runner import run_repro, tasks_for
from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS

CFG = dataclasses.replace(SCALES["tiny"], poisson_duration_s=90.0, testbeds=("7b-4090",), workloads=("poisson-1.1",),
                          sweep_epochs=(5.0,), sweep_workloads=("poisson-1.1",))


def _digest(sc) -> dict:
    return {"needed": {a: (n.gpus, dict(n.tried)) for a, n in sc.needed.items()},
            "results": {a: (r.peak_devices(), r.moves, int(r.active.sum())) for a, r in sc.results.items()},
            "sweep": [(sw.epoch_s, sw.result.moves, sw.unbatched.moves if sw.unbatched else None) for sw in sc.sweep]}


def test_tasks_in_two_processes_give_what_one_scenario_run_gives() -> None:
    lines: list[str] = []
    [par] = run_repro(CFG, progress=lines.append, jobs=2)
    one = run_scenario(build_scenario(TESTBEDS["7b-4090"], WORKLOADS["poisson-1.1"], CFG), CFG)
    assert _digest(par) == _digest(one)
    assert list(par.results) == list(POLICIES) and [sw.epoch_s for sw in par.sweep] == [1.0, 5.0]
    assert headline([par]).line() == headline([one]).line()
    assert any(line.startswith("7b-4090/poisson-1.1: ") for line in lines)  # the scenario's line once it is done


def test_tasks_run_longest_first() -> None:
    cfg = dataclasses.replace(CFG, workloads=("poisson-1.1", "azure-conv"))
    kinds = [WORKLOADS[t.workload].kind for t in tasks_for(cfg)]
    assert kinds == sorted(kinds)  # azure before poisson
    assert len(tasks_for(cfg)) == 2 * len(POLICIES) + 1  # every arm of both, and the sweep's one interval
