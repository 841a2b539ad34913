"""`tidal repro mell`: MELL's evaluation (§VIII, Figs. 11-15) in the KV-packing fleet simulation.

For every testbed x workload the requests are drawn once (loadgen/repro/mell_setup.py) and played on
each policy's devices (loadgen/sim/kv_packing_fleet.py): a request's timing depends on where it runs,
its engine preempts what outgrows a device (the preempted request waits and re-prefills: TTFT/TPOT),
and every policy's moves pay the one movement cost model (kv_packing_moves.MoveModel: Llumnix's
pre-copy over the testbed's kv link, the source held until the hand-over, a stall; or re-prefill).

Arms (the paper's three baselines as §VIII-B defines them, nothing known that a scheduler cannot know):
- BF / WF: best / worst fit by what is known at arrival (the prompt's KV against what each GPU's
  requests hold now); never migrate; an overflowing GPU preempts its newest requests, which wait.
- LB: Llumnix: worst fit, and each planning interval migrates one request per (overloaded, free)
  GPU pair, one migration per GPU at a time, by KV (shared/policy/binpack_lb.py).
- MELL: shared/policy/mell.py, operations batched per planning interval (§VI: moves buffered, the ones
  the batch's arrivals make unnecessary dropped), at most `max_migrations_per_op` moves per operation
  (Theorem 3's 10), each move KV or tokens within MELL §V's boundaries (adaptive migration).
- MELL-uncapped: MELL without the cap and without batching, operations one by one: the most moves one
  operation needs (Theorem 3) on this workload.
- BF-reserve / WF-reserve (labelled extra arms): reserve each request's final KV at admission, a
  hindsight no scheduler has (MELL Finding 2); on the undelayed op stream (they never overflow).
- MELL-free (extra arm): MELL on the undelayed op stream with instant, free moves (kv_packing.run_policy):
  the GPUs its packing needs before any move costs anything.
- MELL-core (`core=True`): MELL through the planner core as live (kv_packing_core.run_core), on the
  undelayed op stream with the move ledger; a check of the live path, not a paper arm.

The planning interval (1 s by default; the paper does not state MELL's epoch length) is swept for MELL
on `sweep_workloads`. The lower bound beside every scenario is the Martello-Toth L2 bound on the peak
GPUs of the undelayed stream (kv_packing_bounds.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from loadgen.repro.mell_footprint import final_sizes, reserved_bytes
from loadgen.repro.mell_service import Needed, Slo, gpus_needed_at_slo
from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS, Testbed, Workload, workload_requests
from loadgen.sim.kv_packing import PackingResult, Schedule, build_schedule, run_policy, utilisation
from loadgen.sim.kv_packing_bounds import peak_lower_bound
from loadgen.sim.kv_packing_fleet import Budgets, FleetResult, pool_devices, run_fleet
from loadgen.sim.kv_packing_moves import MoveModel
from shared.policy.binpack_baselines import BASELINES, BestFitReserve, LoadBalance, LoadBalanceOpen, WorstFitReserve
from shared.policy.packer import RepackFit

PAPER = ("BF", "WF", "LB")  # the paper's baselines as it ran them: requests wait ("latency for GPUs" rows)
EQ2 = ("BF-restart", "WF-restart", "LB-open")  # the same baselines keeping every request's KV resident (Eq. 2)
FAMILY = {"BF": ("BF", "BF-restart"), "WF": ("WF", "WF-restart"), "LB": ("LB", "LB-open")}
OURS = "Ours"  # shared/policy/packer.py
OURS_MODE = "tokens"  # how ours moves (why: docs/benchmarks.md, MELL section)
SERVICE = (*PAPER, *EQ2, "MELL", OURS)  # every arm whose GPUs at the SLO are bisected
FLEET = (*SERVICE, "MELL-uncapped")
RESERVING = ("BF-reserve", "WF-reserve")  # hindsight arms: reserve the final KV at admission
FREE = "MELL-free"  # MELL on the undelayed op stream, moves instant and free: its packing alone
POLICIES = (*FLEET, FREE, *RESERVING)
UNCAPPED = 10**9
UNBATCHED = "MELL-uncapped"  # MELL's ops one by one: batching_cut's reference (uncapped: an operation needing 11
# moves makes all 11, where MELL-nobatch would stop at 10; the report gives max_requests_per_op)
LLUMNIX_MIGRATE_OUT_STEPS = 3  # Llumnix's migrate-out threshold: 3 decode steps of free KV per request


@dataclass(frozen=True)
class ReproConfig:
    poisson_duration_s: float = 3600.0
    azure_duration_s: float = 3600.0  # the trace's hour, at its own arrival times
    epoch_s: float = 1.0  # planning interval
    granule_fraction: int = 64  # KV is reported to the policies in granules of C / this
    occupancy: float = 0.75  # KV share of a device read per decode step (sets the step time)
    seed: int = 0
    max_migrations_per_op: int = 10
    testbeds: tuple[str, ...] = tuple(TESTBEDS)
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    sweep_epochs: tuple[float, ...] = (0.5, 2.0, 5.0, 10.0)  # MELL's planning interval, besides epoch_s
    sweep_workloads: tuple[str, ...] = ("poisson-0.5",)
    azure_dir: str | None = None  # default: ../shared/data/azure-llm-2023
    azure_lengths: str = "paper"  # "paper": LMSYS-like x10 (§VIII-B's inputs); "trace": the trace's own
    core: bool = False  # also run MELL through the planner core (the live path) on the undelayed stream
    slo: Slo = Slo()  # the service every arm's GPUs are measured at (loadgen/repro/mell_service.py)


SCALES: dict[str, ReproConfig] = {
    "paper": ReproConfig(),
    "tiny": ReproConfig(poisson_duration_s=240.0, azure_duration_s=240.0, workloads=("poisson-1.1", "azure-conv"),
                        sweep_epochs=(5.0,), sweep_workloads=("poisson-1.1",)),
    "reduced": ReproConfig(poisson_duration_s=900.0, azure_duration_s=900.0),  # a quarter hour of each
}


@dataclass
class Sweep:
    epoch_s: float
    result: FleetResult
    lower_bound: int
    unbatched: FleetResult | None = None  # MELL's ops one by one at this interval

    @property
    def cut(self) -> float:
        return executed_cut(self.result, self.unbatched)


@dataclass
class Scenario:
    testbed: Testbed
    workload: Workload
    schedule: Schedule
    decode_step_s: float
    moves: MoveModel  # what every policy's moves cost on this testbed
    budgets: Budgets  # MELL §V's boundaries on this testbed
    results: dict[str, PackingResult] = field(default_factory=dict)
    final_size: dict[str, int] = field(default_factory=dict)  # request -> final KV footprint (the reserve arms)
    reserved_bytes: np.ndarray | None = None  # per epoch, what the reserving arms hold
    lower_bound_l1: int = 0
    lower_bound: int = 0  # L2 on the peak GPUs of the undelayed stream
    sweep: list[Sweep] = field(default_factory=list)
    needed: dict[str, Needed] = field(default_factory=dict)  # arm -> its GPUs at the SLO
    wall_s: dict[str, float] = field(default_factory=dict)  # arm -> seconds: its run on demand + its pool search

    @property
    def key(self) -> str:
        return f"{self.testbed.key}/{self.workload.key}"

    @property
    def requests(self) -> int:
        return self.schedule.requests

    def util(self, policy: str) -> float:
        return utilisation(self.schedule, self.results[policy])

    def migrations(self, policy: str) -> int:
        """Migrations carried out (KV hand-overs + token moves); restarts for the restart ablations."""
        return self.results[policy].moves

    def rate(self, policy: str) -> float:
        r = self.results[policy]
        return r.moves / (len(r.active) * self.schedule.epoch_s)

    def per_request(self, policy: str) -> float:
        return self.results[policy].moves / self.requests

    def reserved_share(self, policy: str) -> float:
        """Time-averaged share of the active GPUs' KV memory held (in use + reserved)."""
        held = self.reserved_bytes if policy in RESERVING else self.schedule.used_bytes
        active = self.results[policy].active
        provisioned = float(active.sum()) * self.schedule.capacity
        return float(held[: len(active)].sum()) / provisioned if provisioned else 0.0


def budgets_for(testbed: Testbed, schedule: Schedule, occupancy: float) -> Budgets:
    """MELL §V's boundaries per second (the paper profiles them offline; ours from the testbed's profile):
    communication: one device's kv link (§VIII-B: 10 Gbps between machines), so a KV copy started in an
    interval is done within about one; computation: the re-prefill tokens a destination's memory-bound
    decode steps leave compute for (§V: "a prefill ... with short tokens ... can use idle computation
    resource"): a decode step of the profile at `occupancy` takes `step` and its batch's own tokens take
    batch x the per-token prefill time, the rest of each step is idle compute."""
    profile = testbed.profile()
    link = profile.movement_costs().kv.bandwidth_bytes_per_s
    step, per_token = schedule.decode_step_s, schedule.prefill_s_per_token
    assert schedule.prompt is not None and schedule.output is not None
    mean_tokens = float(np.mean(schedule.prompt + schedule.output / 2)) if schedule.requests else 1.0
    batch = occupancy * (schedule.capacity // schedule.bytes_per_token) / max(1.0, mean_tokens)
    idle = max(0.0, 1.0 - batch * per_token / step)
    return Budgets(link_bytes_per_s=link, prefill_tokens_per_s=idle / per_token if per_token else 0.0)


def make_schedule(testbed: Testbed, workload: Workload, cfg: ReproConfig, epoch_s: float | None = None) -> Schedule:
    duration = cfg.poisson_duration_s if workload.kind == "poisson" else cfg.azure_duration_s
    times, prompt, output = workload_requests(workload, duration, cfg.seed, azure_dir=cfg.azure_dir,
                                              azure_lengths=cfg.azure_lengths)
    capacity = testbed.capacity()
    bpt = testbed.model.kv_bytes_per_token()
    block = testbed.profile().worker.block_size  # a granule is whole engine blocks: its blocks never exceed it
    return build_schedule(times, prompt, output, capacity=capacity, bytes_per_token=bpt,
                          granule_tokens=max(block, capacity // bpt // cfg.granule_fraction // block * block),
                          epoch_s=epoch_s or cfg.epoch_s, prefill_s_per_token=testbed.prefill_s_per_token(),
                          decode_step_s=testbed.decode_step_s(cfg.occupancy))


def build_scenario(testbed: Testbed, workload: Workload, cfg: ReproConfig) -> Scenario:
    schedule = make_schedule(testbed, workload, cfg)
    step = schedule.decode_step_s
    profile = testbed.profile()
    moves = MoveModel(profile.movement_costs(), schedule.bytes_per_token, profile.worker.block_size, step,
                      profile.step)
    return Scenario(testbed, workload, schedule, step, moves, budgets_for(testbed, schedule, cfg.occupancy))


def make_policy(name: str, capacity: int, cfg: ReproConfig, final_size: dict[str, int] | None = None,
                bytes_per_token: int = 1, pool: int | None = None):
    devices = pool_devices(pool) if pool is not None else None
    if name in RESERVING:
        return {"BF-reserve": BestFitReserve, "WF-reserve": WorstFitReserve}[name](capacity, final_size=final_size)
    if name in ("LB", "LB-open"):
        cls = LoadBalance if name == "LB" else LoadBalanceOpen
        return cls(capacity, devices, migrate_out_free=LLUMNIX_MIGRATE_OUT_STEPS * bytes_per_token)
    if name == OURS:  # with Llumnix's balancing round (docs/benchmarks.md, MELL section: why)
        return RepackFit(capacity, devices, balance=True,
                         migrate_out_free=LLUMNIX_MIGRATE_OUT_STEPS * bytes_per_token)
    if name in BASELINES:
        return BASELINES[name](capacity, devices)
    from shared.policy.mell import MellScheduler

    if name == "MELL-uncapped":  # the same bundles as with the cap: only the cap is lifted
        return MellScheduler(capacity, max_migrations_per_op=UNCAPPED, batching=False,
                             bundle_members=max(1, cfg.max_migrations_per_op // 2))
    return MellScheduler(capacity, devices, max_migrations_per_op=cfg.max_migrations_per_op,
                         batching=name != "MELL-nobatch")


def run_arm(name: str, schedule: Schedule, moves: MoveModel, budgets: Budgets, cfg: ReproConfig,
            final_size: dict[str, int] | None = None, pool: int | None = None) -> PackingResult:
    """One arm; `pool`: on a fixed pool of that many GPUs (arrivals that fit nowhere wait), stopped early once
    so many requests missed the SLO's TTFT or TPOT target that its percentile misses it for certain."""
    policy = make_policy(name, schedule.capacity, cfg, final_size, schedule.bytes_per_token, pool)
    if name in RESERVING or name == FREE:
        return run_policy(schedule, policy, name)
    adaptive = name.startswith("MELL")  # MELL §V's adaptive migration
    mode = "auto" if adaptive else ("tokens" if name in ("BF-restart", "WF-restart") else "kv")
    if name == OURS:
        mode = OURS_MODE
    abort = (cfg.slo.ttft_s, cfg.slo.tpot_s(schedule.decode_step_s), cfg.slo.misses_to_fail(schedule.requests)) \
        if pool is not None else None
    return run_fleet(schedule, policy, name, moves=moves, mode=mode, budgets=budgets if adaptive else None,
                     per_op=name in ("MELL-uncapped", "MELL-nobatch"), pool=pool, abort_late=abort)


def executed_cut(batched: FleetResult, unbatched: FleetResult | None) -> float:
    """Share of the migrations MELL carries out op by op that its batches do not (executed, batched vs not)."""
    if unbatched is None or not unbatched.moves:
        return 0.0
    return 1.0 - batched.moves / unbatched.moves


def prepare(scenario: Scenario) -> Scenario:
    """What every arm of a scenario shares: the final sizes (reserving arms) and the lower bounds."""
    s = scenario.schedule
    if not scenario.final_size:
        scenario.final_size = final_sizes(s)
        scenario.reserved_bytes = reserved_bytes(s, scenario.final_size)
        scenario.lower_bound_l1, scenario.lower_bound = peak_lower_bound(s)
    return scenario


def arm_outcome(scenario: Scenario, name: str, cfg: ReproConfig) -> tuple[PackingResult, Needed | None]:
    """One arm on demand, and for the arms at equal service its GPUs at the SLO (the pool search)."""
    s = prepare(scenario).schedule
    result = run_arm(name, s, scenario.moves, scenario.budgets, cfg, scenario.final_size)
    needed = None
    if name in SERVICE:
        needed = gpus_needed_at_slo(lambda n: run_arm(name, s, scenario.moves, scenario.budgets, cfg, pool=n),
                                    result, scenario.lower_bound, cfg.slo, s.decode_step_s)  # type: ignore[arg-type]
    return result, needed


def sweep_at(scenario: Scenario, epoch: float, cfg: ReproConfig) -> Sweep:
    """MELL batched and op by op at another planning interval (the interval sweep)."""
    sched = make_schedule(scenario.testbed, scenario.workload, cfg, epoch)
    b = budgets_for(scenario.testbed, sched, cfg.occupancy)
    result = run_arm("MELL", sched, scenario.moves, b, cfg)
    unbatched = run_arm(UNBATCHED, sched, scenario.moves, b, cfg)
    return Sweep(epoch, result, peak_lower_bound(sched)[1], unbatched)  # type: ignore[arg-type]


def sweep_epochs(scenario: Scenario, cfg: ReproConfig) -> tuple[float, ...]:
    """The other planning intervals the scenario is swept at (none unless it is a sweep workload)."""
    if scenario.workload.key not in cfg.sweep_workloads:
        return ()
    return tuple(e for e in cfg.sweep_epochs if e != cfg.epoch_s)


def finish_sweep(scenario: Scenario, cfg: ReproConfig) -> None:
    """The sweep's entry at the main interval (the scenario's own MELL runs), in interval order."""
    if scenario.workload.key not in cfg.sweep_workloads:
        return
    scenario.sweep.append(Sweep(cfg.epoch_s, scenario.results["MELL"], scenario.lower_bound,  # type: ignore[arg-type]
                                scenario.results.get(UNBATCHED)))  # type: ignore[arg-type]
    scenario.sweep.sort(key=lambda sw: sw.epoch_s)


def run_core_arm(scenario: Scenario, cfg: ReproConfig) -> PackingResult:
    """MELL through the planner core as live, on the undelayed op stream (`--core`)."""
    from loadgen.sim.kv_packing_core import run_core

    s, b = scenario.schedule, scenario.budgets
    return run_core(s, "MELL-core", max_migrations_per_op=cfg.max_migrations_per_op, moves=scenario.moves,
                    migration="auto", link_budget_bytes=b.link_bytes_per_s * s.epoch_s,
                    prefill_budget_tokens=b.prefill_tokens_per_s * s.epoch_s)


def run_scenario(scenario: Scenario, cfg: ReproConfig, policies: tuple[str, ...] = POLICIES) -> Scenario:
    """Every arm of one scenario in this process (mell_runner.py spreads them over processes)."""
    prepare(scenario)
    for name in policies:
        started = time.perf_counter()
        scenario.results[name], needed = arm_outcome(scenario, name, cfg)
        if needed is not None:
            scenario.needed[name] = needed
        scenario.wall_s[name] = time.perf_counter() - started
    if cfg.core:
        scenario.results["MELL-core"] = run_core_arm(scenario, cfg)
    if sweep_epochs(scenario, cfg):
        started = time.perf_counter()
        scenario.sweep.extend(sweep_at(scenario, epoch, cfg) for epoch in sweep_epochs(scenario, cfg))
        scenario.wall_s["interval sweep"] = time.perf_counter() - started
    finish_sweep(scenario, cfg)
    return scenario


@dataclass(frozen=True)
class Headline:
    gpus_vs: dict[str, float]  # baseline -> mean over scenarios of MELL's GPUs at the SLO / the family's best - 1
    gpus_ours_vs_best_baseline: float  # mean over scenarios of ours / the best baseline arm's, at the SLO, - 1
    batching_cut: float  # mean over scenarios of the executed migrations MELL's batching removes
    max_items_per_op: int  # MELL-uncapped: the most items one operation moved (a multi-item counts once)
    max_requests_per_op: int  # ... the most requests
    moves_per_request: float  # MELL's executed migrations per request, mean over scenarios
    gpus_vs_lower_bound: float  # mean over scenarios of MELL's GPUs at the SLO / the L2 bound - 1
    scenarios: int = 0  # scenarios where every arm of the line met the SLO somewhere

    def line(self) -> str:
        def pct(v: float) -> str:  # NaN where no scenario had every arm meet the SLO (e.g. a slow measured device)
            return "n/a" if v != v else f"{round(100 * v):+d}%"

        gpus = " ".join(f"gpus_vs_{b.lower()}={pct(v)}" for b, v in self.gpus_vs.items())
        return (f"repro mell: {gpus} gpus_ours_vs_best_baseline={pct(self.gpus_ours_vs_best_baseline)} "
                f"batching_cut={pct(-self.batching_cut)} max_items_per_op={self.max_items_per_op} "
                f"max_requests_per_op={self.max_requests_per_op} moves_per_request={self.moves_per_request:.1f} "
                f"gpus_vs_lower_bound={pct(self.gpus_vs_lower_bound)}")


def gpus_needed(result: PackingResult) -> float:
    """Peak GPUs on demand from the placement (MELL's B(x), Eq. 3); a copy's drained source is beside it."""
    return float(result.peak_devices())


def at_slo(sc: Scenario, arm: str) -> int | None:
    n = sc.needed.get(arm)
    return None if n is None else n.gpus


def family_best(sc: Scenario, base: str) -> int | None:
    """The fewest GPUs at the SLO of a baseline's arms (as the paper ran it, and keeping Eq. 2)."""
    got = [g for a in FAMILY[base] if (g := at_slo(sc, a)) is not None]
    return min(got) if got else None


def best_baseline(sc: Scenario) -> int | None:
    got = [g for a in (*PAPER, *EQ2) if (g := at_slo(sc, a)) is not None]
    return min(got) if got else None


def batching_cut(result: PackingResult) -> float:
    """Share of the moves MELL's operations decided that its batches removed (decided, not executed)."""
    removed = getattr(result, "removed_by_batching", 0)
    total = result.moves_before_dedup
    return removed / total if total else 0.0


def _mean_rel(pairs: list[tuple[int | None, int | None]]) -> float:
    v = [a / b - 1 for a, b in pairs if a is not None and b]
    return float(np.mean(v)) if v else float("nan")


def headline(scenarios: list[Scenario]) -> Headline:
    uncapped = [sc.results["MELL-uncapped"] for sc in scenarios if "MELL-uncapped" in sc.results]
    return Headline(
        gpus_vs={b: _mean_rel([(at_slo(sc, "MELL"), family_best(sc, b)) for sc in scenarios]) for b in PAPER},
        gpus_ours_vs_best_baseline=_mean_rel([(at_slo(sc, OURS), best_baseline(sc)) for sc in scenarios]),
        batching_cut=float(np.mean([executed_cut(sc.results["MELL"], sc.results.get(UNBATCHED))  # type: ignore
                                    for sc in scenarios])),
        max_items_per_op=max((getattr(r, "max_items_per_op", -1) for r in uncapped), default=-1),
        max_requests_per_op=max((r.max_moves_per_op for r in uncapped), default=-1),
        moves_per_request=float(np.mean([sc.per_request("MELL") for sc in scenarios])),
        gpus_vs_lower_bound=_mean_rel([(at_slo(sc, "MELL"), sc.lower_bound) for sc in scenarios]),
        scenarios=sum(all(at_slo(sc, a) is not None for a in ("MELL", OURS)) for sc in scenarios))
