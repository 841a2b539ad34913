"""`tidal repro mell`'s scenarios run arm by arm over processes (loadgen/repro/mell.py runs one arm).

Why: a scenario's arms are independent (each plays the same requests on its own policy and searches its own
pool), and the scenarios differ ~20x in cost (an Azure hour with 60 GPUs against a Poisson hour with 10), so
spreading whole scenarios over `jobs` processes left one process on the last Azure hour while the others
idled. Here every (scenario, arm) pair is one task, and so is each planning interval of MELL's sweep; the
tasks run longest first (Azure, then the Poisson hours by rate; the pool-searched arms before the one-run
arms) and each process builds a scenario's requests once (`_prepared`). The results are the ones one process
gives (every run is deterministic): only the wall time changes.
"""
from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from loadgen.repro.mell import (
    POLICIES, SERVICE, ReproConfig, Scenario, Sweep, arm_outcome, build_scenario, finish_sweep, prepare, run_core_arm,
    sweep_at,
)
from loadgen.repro.mell_service import Needed
from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS
from loadgen.sim.kv_packing import PackingResult

_CACHE: dict[tuple[str, str, ReproConfig], Scenario] = {}


def _prepared(tb: str, wl: str, cfg: ReproConfig) -> Scenario:
    """The scenario's requests and bounds, built once per process (results are kept per task, not here)."""
    key = (tb, wl, cfg)
    if key not in _CACHE:
        _CACHE[key] = prepare(build_scenario(TESTBEDS[tb], WORKLOADS[wl], cfg))
    return _CACHE[key]


@dataclass(frozen=True)
class Task:
    testbed: str
    workload: str
    kind: str  # "arm", "sweep" (MELL at another planning interval) or "core"
    name: str  # the arm, or the interval in seconds
    cfg: ReproConfig

    def cost_rank(self) -> tuple:
        """Larger first: Azure before Poisson, frequent arrivals first, searched arms before single runs."""
        w = WORKLOADS[self.workload]
        heavy = 0 if w.kind == "azure" else 1
        searched = 0 if (self.kind == "sweep" or self.name in SERVICE) else 1
        return heavy, searched, self.workload, self.testbed, self.kind, self.name


@dataclass
class Outcome:
    task: Task
    result: PackingResult | None = None
    needed: Needed | None = None
    sweep: Sweep | None = None
    wall_s: float = 0.0


def run_task(task: Task) -> Outcome:
    started = time.perf_counter()
    sc = _prepared(task.testbed, task.workload, task.cfg)
    out = Outcome(task)
    if task.kind == "arm":
        out.result, out.needed = arm_outcome(sc, task.name, task.cfg)
    elif task.kind == "sweep":
        out.sweep = sweep_at(sc, float(task.name), task.cfg)
    else:
        out.result = run_core_arm(sc, task.cfg)
    out.wall_s = time.perf_counter() - started
    return out


def tasks_for(cfg: ReproConfig) -> list[Task]:
    todo: list[Task] = []
    for tb in cfg.testbeds:
        for wl in cfg.workloads:
            todo.extend(Task(tb, wl, "arm", name, cfg) for name in POLICIES)
            if cfg.core:
                todo.append(Task(tb, wl, "core", "MELL-core", cfg))
            if wl in cfg.sweep_workloads:
                todo.extend(Task(tb, wl, "sweep", repr(e), cfg) for e in cfg.sweep_epochs if e != cfg.epoch_s)
    return sorted(todo, key=Task.cost_rank)


def _check_traces(cfg: ReproConfig) -> None:
    """A missing Azure trace fails before anything runs."""
    for wl in cfg.workloads:
        if WORKLOADS[wl].kind == "azure":
            from loadgen.repro.mell_setup import AZURE_DIR, AZURE_FILES, azure_trace

            folder = cfg.azure_dir or AZURE_DIR
            if not (Path(folder) / AZURE_FILES[WORKLOADS[wl].service]).is_file():
                azure_trace(WORKLOADS[wl].service, 1.0, cfg.azure_dir)  # raises AzureTraceMissing


def run_repro(cfg: ReproConfig, progress=None, jobs: int = 1) -> list[Scenario]:
    """Every testbed x workload, arm by arm; `jobs` > 1 runs the tasks in that many processes (same results)."""
    _check_traces(cfg)
    todo = tasks_for(cfg)
    left: dict[tuple[str, str], int] = {}
    for t in todo:
        left[(t.testbed, t.workload)] = left.get((t.testbed, t.workload), 0) + 1
    scenarios: dict[tuple[str, str], Scenario] = {}

    def collect(o: Outcome) -> None:
        t = o.task
        key = (t.testbed, t.workload)
        sc = scenarios.get(key)
        if sc is None:  # a fresh one: the per-process cache holds requests only, results go here
            base = _prepared(t.testbed, t.workload, cfg)
            sc = scenarios[key] = Scenario(base.testbed, base.workload, base.schedule, base.decode_step_s, base.moves,
                                           base.budgets, final_size=base.final_size,
                                           reserved_bytes=base.reserved_bytes, lower_bound_l1=base.lower_bound_l1,
                                           lower_bound=base.lower_bound)
        if t.kind == "arm":
            sc.results[t.name] = o.result  # type: ignore[assignment]
            if o.needed is not None:
                sc.needed[t.name] = o.needed
            sc.wall_s[t.name] = o.wall_s
        elif t.kind == "core":
            sc.results[t.name] = o.result  # type: ignore[assignment]
        else:
            sc.sweep.append(o.sweep)  # type: ignore[arg-type]
            sc.wall_s["interval sweep"] = sc.wall_s.get("interval sweep", 0.0) + o.wall_s
        if progress and o.needed is not None:  # a long run shows its arms as they end
            progress(f"  {sc.key} {t.name}: {o.needed.gpus if o.needed.gpus is not None else 'none'} GPUs at the SLO "
                     f"(pools {' '.join(f'{n}{chr(10003) if ok else chr(10007)}' for n, ok in sorted(o.needed.tried.items()))}"
                     f"; {o.wall_s:.0f} s)")
        left[key] -= 1
        if not left[key]:
            _finish(sc, cfg, progress)

    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo))) as pool:
            for fut in as_completed([pool.submit(run_task, t) for t in todo]):
                collect(fut.result())
    else:
        for t in todo:
            collect(run_task(t))
    return [scenarios[(tb, wl)] for tb in cfg.testbeds for wl in cfg.workloads]


def _finish(sc: Scenario, cfg: ReproConfig, progress) -> None:
    sc.results = {p: sc.results[p] for p in (*POLICIES, "MELL-core") if p in sc.results}  # the arms' order
    sc.needed = {p: sc.needed[p] for p in POLICIES if p in sc.needed}
    order = [*POLICIES, "interval sweep"]
    sc.wall_s = {p: sc.wall_s[p] for p in order if p in sc.wall_s}
    finish_sweep(sc, cfg)
    if progress:
        wall = sum(sc.wall_s.values())
        progress(f"{sc.key}: {sc.requests} requests, L2 bound {sc.lower_bound} GPUs; at the SLO "
                 + ", ".join(f"{p} {n.gpus if n.gpus is not None else 'none'}" for p, n in sc.needed.items())
                 + "; peak on demand " + ", ".join(f"{p} {r.peak_devices()}" for p, r in sc.results.items())
                 + f" ({wall:.1f} s of runs: " + ", ".join(
                     f"{p} {w:.0f} s" + (f"/{sc.needed[p].runs} pools" if p in sc.needed else "")
                     for p, w in sc.wall_s.items()) + ")")


__all__ = ["Task", "run_repro", "run_task", "tasks_for"]
