"""WarmServe as a planner policy: forecasts become instances and prewarmed replicas (pure).

Every interval, per catalog model with a current `Forecast` (view.forecasts; L_A, L_P in concurrent
requests by Little's law, B = the batch size):

1. **Scale up** to max(⌈L_A/B⌉, ⌈observed/B⌉) accepting instances (observed: running + waiting on
   them now, plus the dispatchers' queue of the model once it has lasted `scale_out_after_s`: a
   sustained queue is demand the instances cannot take, whatever the forecast says; the reactive
   part, which the burst prewarms are for), less scale-ups in flight (its own and the
   capacity-request path's). Each `ScaleUp` (LoadModel) goes to the usable worker
   without an instance of the model that holds the most warm bytes of it (a prewarm hit: no
   checkpoint read), then an idle or universal one before a serving one, then the one whose warm
   replicas of other models score least (§5.2: dedication evicts the least score), then the most room.
2. **Scale down**, one instance per model per `scale_down_after_s`: while the accepting instances
   exceed max(⌈L_P/B⌉, ⌈observed/B⌉) for that long (hysteresis) and nothing of the model is queued,
   `ScaleDown` (EvictModel, drain) the least loaded one older than `min_instance_age_s` that runs no
   request now and that no view has shown a request on for `scale_down_after_s` either (a forecast
   lags its window: a busy instance is never stopped on it). Its requests finish; its weights stay prewarmed
   through the worker's grace period (then the worker is universal). L_P = 0 scales to zero; the
   next request is queued by the dispatcher and the capacity path starts the model again.
3. **Prewarm** (`prewarm = true` only): Alg. 1 (`shared/policy/warmserve_placement.place`) places the
   basic and burst replicas of Eqs. 5–8 on idle and universal workers and on grace-period ones
   (proactive, §4.1): room = M − the Eq. 1 target of the draining instance − warm bytes there, and the
   `PlacePrewarm` caps that instance's KV at the target. Warm weights already there (and prewarms in
   flight) are placed replicas, with their model's best scores; those Alg. 1 evicts are released
   (`ReleasePrewarm`). At most one prewarm in flight per worker (a CPU reads one checkpoint at a time).

`prewarm = false`: no prewarm effects; scale-ups and scale-downs still run (cold from the checkpoint).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from shared.events.common import LayerRange
from shared.events.plan import PlacePrewarm, PlanOutcome, ReleasePrewarm, ScaleDown, ScaleUp
from shared.planner.effects import Decision, Effect, action_of, key
from shared.planner.policy import Busy
from shared.planner.scale_up import SCALE_UP_TTL_S, ScaleUpPolicy, room_bytes, scale_up_instance_id
from shared.planner.view import ClusterView, InstanceView, WorkerView
from shared.planner.warmserve_view import (
    DemandSettings, current_forecasts, demand, existing_replicas, gpu_of, grace_target, lifecycle_of, prewarm_layers,
)
from shared.policy.warmserve import (
    Gpu, ModelDemand, PlacedReplica, WorkerLife, WorkerRole, place, prewarm_replicas,
)


@dataclass(frozen=True)
class WarmServeSettings:
    prewarm: bool = True  # [policies] prewarm
    batch_size: int = 64  # B: [policies] max_batch_size
    mean_request_s: float = 2.0  # Little's law: a request's time in the system
    load_bytes_per_s: float = 2e9  # T_c = weights / this (the profiled cold start)
    prewarm_fraction: float = 1.0  # of a model's layers a prewarm holds (§4: the first ones)
    scale_down_after_s: float = 10.0  # hysteresis: the excess must last this long
    min_instance_age_s: float = 5.0  # never stop an instance younger than this
    forecast_max_age_windows: float = 1.0  # a forecast this many windows past its own is ignored
    min_instances: int = 0  # per model with a forecast: 1 when the dispatcher cannot scale from zero
    scale_out_after_s: float = 3.0  # a dispatcher queue lasting this long counts as observed demand

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.mean_request_s <= 0 or not 0 < self.prewarm_fraction <= 1:
            raise ValueError("need batch_size >= 1, mean_request_s > 0, 0 < prewarm_fraction <= 1")
        if self.scale_down_after_s < 0 or self.min_instance_age_s < 0 or self.load_bytes_per_s <= 0:
            raise ValueError("need scale_down_after_s >= 0, min_instance_age_s >= 0, load_bytes_per_s > 0")


class WarmServePolicy:
    name = "warmserve"

    def __init__(self, settings: WarmServeSettings = WarmServeSettings(), *,
                 capacity: ScaleUpPolicy | None = None) -> None:
        self.s = settings
        self.capacity = capacity  # the capacity-request path: its scale-ups in flight count here too
        self.demand_settings = DemandSettings(settings.batch_size, settings.mean_request_s, settings.load_bytes_per_s,
                                              settings.prewarm_fraction)
        self.pending_prewarm: dict[tuple[str, str], int] = {}  # (worker, model) -> bytes, in flight
        self.pending_up: dict[str, set[str]] = {}  # model -> workers with a scale-up in flight
        self.excess_since: dict[str, float] = {}  # model -> since when it has had too many instances
        self.first_seen: dict[str, float] = {}  # instance -> when the view first had it
        self.last_busy: dict[str, float] = {}  # instance -> when the view last saw it with a request
        self.queued_since: dict[str, float] = {}  # model -> since when the dispatchers have queued it
        self.counts: Counter[str] = Counter()  # scale_up_warm, scale_up_cold, scale_down, prewarm, release

    # --- the Policy protocol ----------------------------------------------------------------
    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        workers = view.usable_workers()
        lives = {w.worker_id: lifecycle_of(w) for w in workers}
        self._age(view, workers)
        self._queues(view)
        forecasts = current_forecasts(view, self.s.forecast_max_age_windows)
        demands: list[ModelDemand] = []
        decisions: list[Decision] = []
        taken: set[str] = set()  # workers given an instance this interval: no prewarm there
        for model, fc in forecasts.items():
            active = [i for w in workers for i in w.instances if i.model == model and i.accepting]
            d = demand(view.models[model], fc, len(active), self.demand_settings)
            ups = self._scale_up(view, d, active, workers, lives, taken, busy)
            decisions += ups
            decisions += self._scale_down(view, d, active, busy)
            demands.append(d)
        if self.s.prewarm:
            decisions += self._prewarms(view, demands, workers, lives, taken, busy)
        return decisions

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        action = action_of(effect)
        if isinstance(action, PlacePrewarm):
            self.pending_prewarm.pop((action.worker_id, action.model), None)
        elif isinstance(action, ScaleUp):
            self.pending_up.get(action.model, set()).discard(action.worker_id)

    # --- instances ------------------------------------------------------------------------
    def _age(self, view: ClusterView, workers: list[WorkerView]) -> None:
        present = {i.instance_id for w in workers for i in w.instances}
        for iid in present:
            self.first_seen.setdefault(iid, view.now)
        for inst in (i for w in workers for i in w.instances if i.running or i.waiting or i.requests):
            self.last_busy[inst.instance_id] = view.now
        for iid in set(self.first_seen) - present:
            del self.first_seen[iid]
            self.last_busy.pop(iid, None)

    def _queues(self, view: ClusterView) -> None:
        for model in list(self.queued_since):
            if not view.queued.get(model):
                del self.queued_since[model]
        for model, n in view.queued.items():
            if n > 0:
                self.queued_since.setdefault(model, view.now)

    def _sustained_queue(self, view: ClusterView, model: str) -> int:
        """The model's queued requests once the queue has lasted `scale_out_after_s`, else 0."""
        since = self.queued_since.get(model)
        if since is None or view.now - since < self.s.scale_out_after_s:
            return 0
        return view.queued.get(model, 0)

    def _in_flight(self, model: str) -> int:
        capacity = 1 if self.capacity is not None and model in self.capacity.pending else 0
        return len(self.pending_up.get(model, ())) + capacity

    def _scale_up(self, view: ClusterView, d: ModelDemand, active: list[InstanceView], workers: list[WorkerView],
                  lives: dict[str, WorkerLife], taken: set[str], busy: Busy) -> list[Decision]:
        queued = self._sustained_queue(view, d.model)
        observed = sum(i.running + i.waiting for i in active) + queued
        want = max(math.ceil(d.avg_load / d.batch_size), math.ceil(observed / d.batch_size))
        if queued:
            want = max(want, len(active) + 1)  # a lasting queue: the instances are full, whatever their batch
        out = []
        for _ in range(want - len(active) - self._in_flight(d.model)):
            worker = self._scale_up_worker(view, d.model, workers, lives, taken)
            if worker is None:
                break
            action = ScaleUp(model=d.model, worker_id=worker.worker_id,
                             instance_id=scale_up_instance_id(worker.worker_id, d.model, int(view.now)))
            if busy.has(key(action)):
                break
            warm = worker.prewarmed.get(d.model, 0)
            self.counts["scale_up_warm" if warm else "scale_up_cold"] += 1
            self.pending_up.setdefault(d.model, set()).add(worker.worker_id)
            taken.add(worker.worker_id)
            out.append(Decision(action=action, trigger="forecast", ttl_s=SCALE_UP_TTL_S, reason=(
                f"{d.model}: forecast L_A={d.avg_load:.2f} observed={observed} ({queued} queued for "
                f"{self.s.scale_out_after_s:g}s+) needs {want} instances (B={d.batch_size}),"
                f" {len(active)} serve; {worker.worker_id} " + (f"holds {warm} B warm" if warm else "starts it cold"))))
        return out

    def _scale_up_worker(self, view: ClusterView, model: str, workers: list[WorkerView],
                         lives: dict[str, WorkerLife], taken: set[str]) -> WorkerView | None:
        need = view.models[model].weight_bytes
        best: tuple[tuple[int, bool, int, int, str], WorkerView] | None = None
        for w in workers:
            if w.worker_id in taken or any(i.model == model for i in w.instances):
                continue
            room = room_bytes(w)  # free + every warm byte (given up for an instance) + unused KV
            if room < need:
                continue
            others = sum(b for m, b in w.prewarmed.items() if m != model)  # what dedication evicts
            rank = (-w.prewarmed.get(model, 0), lives[w.worker_id].role is WorkerRole.DEDICATED, others, -room,
                    w.worker_id)
            if best is None or rank < best[0]:
                best = (rank, w)
        return None if best is None else best[1]

    def _scale_down(self, view: ClusterView, d: ModelDemand, active: list[InstanceView], busy: Busy) -> list[Decision]:
        observed = sum(i.running + i.waiting for i in active)
        keep = max(math.ceil(d.peak_load / d.batch_size), math.ceil(observed / d.batch_size), self.s.min_instances)
        if len(active) <= keep or self._in_flight(d.model) or view.queued.get(d.model):
            self.excess_since.pop(d.model, None)
            return []
        since = self.excess_since.setdefault(d.model, view.now)
        if view.now - since < self.s.scale_down_after_s:
            return []
        old = [i for i in active if view.now - self.first_seen.get(i.instance_id, view.now) >= self.s.min_instance_age_s
               and view.now - self.last_busy.get(i.instance_id, -math.inf) >= self.s.scale_down_after_s
               and not (i.running or i.waiting or i.requests)]  # never one with requests now
        for inst in sorted(old, key=lambda i: (i.running + i.waiting, i.instance_id)):
            action = ScaleDown(instance_id=inst.instance_id, worker_id=inst.worker_id, model=d.model)
            if busy.has(key(action)):
                continue
            self.excess_since[d.model] = view.now  # the next one waits its own spell
            self.counts["scale_down"] += 1
            return [Decision(action=action, trigger="forecast", reason=(
                f"{d.model}: {len(active)} instances for forecast peak L_P={d.peak_load:.2f} and {observed} observed "
                f"(keep {keep}) for {self.s.scale_down_after_s:g}s; {inst.instance_id} drains, its weights stay warm"))]
        return []

    # --- prewarming (Alg. 1) ----------------------------------------------------------------
    def _prewarms(self, view: ClusterView, demands: list[ModelDemand], workers: list[WorkerView],
                  lives: dict[str, WorkerLife], taken: set[str], busy: Busy) -> list[Decision]:
        full = {d.model: prewarm_replicas(d) for d in demands}
        existing = existing_replicas(view, workers, full, self.pending_prewarm)
        held: Counter[str] = Counter(r.model for r in existing)
        reduced = [ModelDemand(d.model, d.size_bytes, d.parallel, d.batch_size,
                               d.active + len(self.pending_up.get(d.model, ())) + held[d.model], d.avg_load,
                               d.peak_load, d.cold_start_s) for d in demands]
        gpus = [self._gpu(w, lives[w.worker_id], taken) for w in workers]
        plan = place(reduced, gpus, existing)
        out: list[Decision] = []
        for victim in plan.evicted:
            (worker,) = victim.workers
            if victim in existing and (worker, victim.model) not in self.pending_prewarm:
                self.counts["release"] += 1
                out.append(Decision(action=ReleasePrewarm(worker_id=worker, model=victim.model), trigger="forecast",
                                    freed_bytes=victim.bytes_per_worker,
                                    reason=f"Alg. 1 evicts {victim.model} (score {victim.replica.score:.3g}) on {worker}"))
        busy_workers = {w for w, _ in self.pending_prewarm}
        by_id = {w.worker_id: w for w in workers}
        for placed in plan.placed:
            (worker,) = placed.workers
            if placed in plan.evicted or worker in busy_workers:
                continue
            decision = self._place(view, by_id[worker], lives[worker], placed, busy)
            if decision is not None:
                busy_workers.add(worker)
                out.append(decision)
        return out

    def _gpu(self, worker: WorkerView, life: WorkerLife, taken: set[str]) -> Gpu:
        if worker.worker_id in taken or (life.grace and len(worker.instances) != 1):
            return Gpu(worker=worker.worker_id, server="local", free_bytes=0, role=WorkerRole.DEDICATED,
                       serving=life.serving or "?")  # not a candidate: it gets an instance / cannot be capped
        return gpu_of(worker, life, self.s.batch_size)

    def _place(self, view: ClusterView, worker: WorkerView, life: WorkerLife, placed: PlacedReplica,
               busy: Busy) -> Decision | None:
        record = view.models[placed.model]
        cap_instance, cap = None, None
        if life.grace:
            (inst,) = worker.instances
            cap_instance, cap = inst.instance_id, grace_target(worker, inst, self.s.batch_size)
        action = PlacePrewarm(worker_id=worker.worker_id, model=placed.model,
                              layers=LayerRange(start=0, end=prewarm_layers(record, self.s.prewarm_fraction)),
                              cap_instance_id=cap_instance, kv_cap_bytes=cap)
        if busy.has(key(action)):
            return None
        self.pending_prewarm[(worker.worker_id, placed.model)] = placed.bytes_per_worker
        self.counts["prewarm_proactive" if life.grace else "prewarm"] += 1
        r = placed.replica
        where = f"grace-period {worker.worker_id} (KV capped at {cap} B, Eq. 1)" if life.grace else \
            f"{life.role.value} {worker.worker_id}"
        return Decision(action=action, trigger="forecast", ttl_s=SCALE_UP_TTL_S,
                        reason=f"{r.kind} replica {r.rank} of {placed.model} (score {r.score:.3g}) on {where}")


__all__ = ["WarmServePolicy", "WarmServeSettings"]
