"""`tidal repro mell`: MELL's evaluation (§VIII, Figs. 11-15) in the KV-packing simulator.

For every testbed x workload one op stream is built (loadgen/sim/kv_packing.py) and
replayed on BF, WF, LB (shared/policy/binpack_baselines.py) and MELL with and without
request-operation batching (shared/policy/mell.py). MELL runs as the live cluster runs it:
through the planner core (PlannerCore + MellPolicy), arrivals routed by its placement hints
(loadgen/sim/kv_packing_core.py). MELL-direct (MellScheduler called directly, a request starts
where Allocate puts it) checks that path and, with MELL without batching, is the batching
ablation: both direct, so the cut is MELL's own, not the routing's. MELL without batching runs
its ops one by one, which also measures the most migrations a single operation caused
(Theorem 3 bounds it by 10).

Every policy's moves pay the same costs (loadgen/sim/kv_packing_moves.py, the one movement cost
model over the testbed profile's links): a KV migration is Llumnix's pre-copy over the kv link
with the source held until the hand-over, a stall, and failures (retried); a restart re-prefills.

BF and WF do not migrate, so they reserve each request's final KV footprint at admission
(mell_footprint.py); BF-restart and WF-restart, an ablation outside the paper, admit at the
current size and restart the newest requests of an overflowing GPU elsewhere (repacking by re-prefill).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from loadgen.repro.mell_footprint import final_sizes, reserved_bytes
from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS, Testbed, Workload, arrivals, lmsys_lengths
from loadgen.sim.kv_packing import PackingResult, Schedule, build_schedule, run_policy, utilisation
from loadgen.sim.kv_packing_core import run_core
from loadgen.sim.kv_packing_moves import MoveModel
from shared.policy.binpack_baselines import BASELINES, BestFit, WorstFit

POLICIES = ("BF", "WF", "LB", "MELL", "MELL-direct", "MELL-nobatch", "BF-restart", "WF-restart")
RESERVING = ("BF", "WF")  # policies whose GPUs hold reserved-but-unused KV


@dataclass(frozen=True)
class ReproConfig:
    poisson_duration_s: float = 3600.0
    azure_duration_s: float = 7200.0  # one compressed day
    epoch_s: float = 1.0  # planning interval
    granule_fraction: int = 64  # KV is reported in granules of C / this
    occupancy: float = 0.75  # KV share of a device read per decode step (sets the step time)
    seed: int = 0
    max_migrations_per_op: int = 10
    testbeds: tuple[str, ...] = tuple(TESTBEDS)
    workloads: tuple[str, ...] = tuple(WORKLOADS)


SCALES: dict[str, ReproConfig] = {
    "paper": ReproConfig(),
    "tiny": ReproConfig(poisson_duration_s=240.0, azure_duration_s=240.0, workloads=("poisson-1.1", "azure")),
}


@dataclass
class Scenario:
    testbed: Testbed
    workload: Workload
    schedule: Schedule
    decode_step_s: float
    moves: MoveModel  # what every policy's moves cost on this testbed
    results: dict[str, PackingResult] = field(default_factory=dict)
    final_size: dict[str, int] = field(default_factory=dict)  # request -> final KV footprint (BF/WF reserve it)
    reserved_bytes: np.ndarray | None = None  # per epoch, what the reserving policies hold

    @property
    def key(self) -> str:
        return f"{self.testbed.key}/{self.workload.key}"

    def util(self, policy: str) -> float:
        return utilisation(self.schedule, self.results[policy])

    def rate(self, policy: str) -> float:
        return self.results[policy].moves / self.schedule.duration_s

    def reserved_share(self, policy: str) -> float:
        """Time-averaged share of the active GPUs' KV memory held (in use + reserved)."""
        held = self.reserved_bytes if policy in RESERVING else self.schedule.used_bytes
        active = self.results[policy].active
        provisioned = float(active.sum()) * self.schedule.capacity
        return float(held[: len(active)].sum()) / provisioned if provisioned else 0.0


def make_policy(name: str, capacity: int, cfg: ReproConfig, final_size: dict[str, int] | None = None):
    if name in ("BF", "WF"):
        return {"BF": BestFit, "WF": WorstFit}[name](capacity, final_size=final_size)
    if name in BASELINES:
        return BASELINES[name](capacity)
    from shared.policy.mell import MellScheduler

    return MellScheduler(capacity, max_migrations_per_op=cfg.max_migrations_per_op, batching=name == "MELL-direct")


def build_scenario(testbed: Testbed, workload: Workload, cfg: ReproConfig) -> Scenario:
    duration = cfg.poisson_duration_s if workload.kind == "poisson" else cfg.azure_duration_s
    times = arrivals(workload, duration, cfg.seed)
    prompt, output = lmsys_lengths(np.random.default_rng(cfg.seed + 1), len(times))
    capacity = testbed.capacity()
    bpt = testbed.model.kv_bytes_per_token()
    step = testbed.decode_step_s(cfg.occupancy)
    profile = testbed.profile()
    moves = MoveModel(profile.movement_costs(), bpt, profile.worker.block_size, step, profile.step)
    schedule = build_schedule(times, prompt, output, capacity=capacity, bytes_per_token=bpt,
                              granule_tokens=max(1, capacity // bpt // cfg.granule_fraction), epoch_s=cfg.epoch_s,
                              prefill_s_per_token=testbed.prefill_s_per_token(), decode_step_s=step)
    return Scenario(testbed, workload, schedule, step, moves)


def run_scenario(scenario: Scenario, cfg: ReproConfig, policies: tuple[str, ...] = POLICIES) -> Scenario:
    capacity = scenario.schedule.capacity
    if not scenario.final_size:
        scenario.final_size = final_sizes(scenario.schedule)
        scenario.reserved_bytes = reserved_bytes(scenario.schedule, scenario.final_size)
    for name in policies:
        if name == "MELL":  # through the planner core, as live (kv_packing_core)
            scenario.results[name] = run_core(scenario.schedule, name, max_migrations_per_op=cfg.max_migrations_per_op,
                                              moves=scenario.moves)
            continue
        policy = make_policy(name, capacity, cfg, scenario.final_size)
        scenario.results[name] = run_policy(scenario.schedule, policy, name, per_op=name == "MELL-nobatch",
                                            moves=scenario.moves)
    return scenario


def run_repro(cfg: ReproConfig, progress=None) -> list[Scenario]:
    scenarios = []
    for tb in cfg.testbeds:
        for wl in cfg.workloads:
            started = time.perf_counter()
            sc = run_scenario(build_scenario(TESTBEDS[tb], WORKLOADS[wl], cfg), cfg)
            scenarios.append(sc)
            if progress:
                progress(f"{sc.key}: {sc.schedule.requests} requests, "
                         + ", ".join(f"{p} {r.peak_devices()} GPUs" for p, r in sc.results.items())
                         + f" ({time.perf_counter() - started:.1f} s)")
    return scenarios


@dataclass(frozen=True)
class Headline:
    gpus_vs: dict[str, float]  # baseline -> mean over scenarios of MELL's GPUs / baseline's - 1
    util: float  # MELL's mean utilisation
    batching_cut: float  # mean over scenarios of 1 - migrations(batching) / migrations(no batching)
    max_migrations_per_op: int

    def line(self) -> str:
        gpus = " ".join(f"gpus_vs_{b.lower()}={round(100 * v):+d}%" for b, v in self.gpus_vs.items())
        return (f"repro mell: {gpus} util={round(100 * self.util)}% "
                f"batching_cut={round(-100 * self.batching_cut):+d}% max_migrations_per_op={self.max_migrations_per_op}")


def gpus_needed(result: PackingResult) -> float:
    """GPUs needed: the peak number of active GPUs, MELL's B(x) (eq. 3); the report shows the
    time-averaged number beside it."""
    return float(result.peak_devices())


def batched_mell(sc: Scenario) -> str:
    """The batched MELL run to compare with MELL-nobatch: the direct one when it ran."""
    return "MELL-direct" if "MELL-direct" in sc.results else "MELL"


def headline(scenarios: list[Scenario]) -> Headline:
    def rel(sc: Scenario, base: str) -> float:
        return gpus_needed(sc.results["MELL"]) / gpus_needed(sc.results[base]) - 1

    def cut(sc: Scenario) -> float:  # MELL's own ablation: both direct (the core path adds routing misses)
        off = sc.results["MELL-nobatch"].moves
        return 1 - sc.results[batched_mell(sc)].moves / off if off else 0.0

    return Headline(gpus_vs={b: float(np.mean([rel(sc, b) for sc in scenarios])) for b in ("BF", "WF", "LB")},
                    util=float(np.mean([sc.util("MELL") for sc in scenarios])),
                    batching_cut=float(np.mean([cut(sc) for sc in scenarios])),
                    max_migrations_per_op=max(sc.results["MELL-nobatch"].max_moves_per_op for sc in scenarios))
