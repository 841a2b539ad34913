"""WarmServe as a planner policy: the autoscaler starts and stops instances, forecasts place prewarms (pure).

Every interval:

1. **Autoscale** each catalog model with the public code's autoscaler (shared/policy/autoscaler.py, the
   rule the fleet simulator runs too): its load is the requests in the system (running and waiting on
   its instances, draining ones included, plus the dispatchers' queue of it), sampled every interval and
   averaged over the autoscaler's window (5 s); its capacity is B (`[policies] max_batch_size`) per
   accepting instance, starts in flight included. Above 0.8 of it: `ScaleUp` (LoadModel) onto the usable
   worker without the model (and not starting it) that holds the most warm bytes of it (a prewarm hit: no
   checkpoint read), then an idle or universal one before a serving one, then the one whose warm replicas
   of other models score least (§5.2), then the most room. Below 0.5: `ScaleDown` (EvictModel, drain) of
   the least busy instances older than the protect period (5 s) — never one with requests now, never
   below `min_instances`, never one idle for less than `keep_alive_s` (Ollama's keep-alive: the default
   config keeps 5 min), and not while the dispatchers hold requests of the model. Its weights stay
   prewarmed through the worker's grace period (then the worker is universal). A model below
   `min_instances` (1 in the default config) gets a start; with 0, idle models scale to zero and the
   next request is queued by the dispatcher and the capacity path starts the model again. With
   `saturation` set, a model the request count calls fine but whose measured queue wait or decode pace
   says saturated (shared/policy/saturation.py) gets one more instance when none is starting, and no
   scale-down while saturated.
   A start counts as starting from its decision until the worker's stats list the instance
   (`StartTracker`, shared with the capacity path): one decision, one LoadModel.
2. **Prewarm** (`prewarm = true` only), for the models with a current `Forecast` (L_A, L_P in concurrent
   requests by Little's law): Alg. 1 (`shared/policy/warmserve_placement.place`) places the basic and
   burst replicas of Eqs. 5–8 on idle and universal workers and on grace-period ones (proactive, §4.1):
   room = M − the Eq. 1 target of the draining instance − warm bytes there, and the `PlacePrewarm` caps
   that instance's KV at the target. Warm weights already there (and prewarms in flight) are placed
   replicas, with their model's best scores; those Alg. 1 evicts are released (`ReleasePrewarm`). At
   most one prewarm in flight per worker (a CPU reads one checkpoint at a time).

`prewarm = false`: no prewarm effects; scale-ups and scale-downs still run (cold from the checkpoint).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shared.events.common import LayerRange
from shared.events.plan import PlacePrewarm, PlanCancelled, PlanOutcome, ReleasePrewarm, ScaleDown, ScaleUp
from shared.planner.effects import Decision, Effect, action_of, key
from shared.planner.policy import Busy
from shared.planner.scale_up import SCALE_UP_TTL_S, ScaleUpPolicy, StartTracker, room_bytes, scale_up_instance_id
from shared.planner.view import ClusterView, WorkerView
from shared.planner.warmserve_view import (
    DemandSettings, current_forecasts, demand, existing_replicas, gpu_of, grace_target, lifecycle_of, prewarm_layers,
)
from shared.policy.autoscaler import AutoscaleParams, LoadWindow, Member, decide as autoscale
from shared.policy.saturation import InstanceLoad, SaturationMonitor, SaturationParams
from shared.policy.warmserve import (
    Gpu, ModelDemand, PlacedReplica, WorkerLife, WorkerRole, place, prewarm_replicas,
)


@dataclass(frozen=True)
class WarmServeSettings:
    prewarm: bool = True  # [policies] prewarm
    batch_size: int = 64  # B: [policies] max_batch_size
    mean_request_s: float = 2.0  # Little's law: a request's time in the system (forecast rps -> load)
    load_bytes_per_s: float = 2e9  # T_c = weights / this (the profiled cold start)
    prewarm_fraction: float = 1.0  # of a model's layers a prewarm holds (§4: the first ones)
    forecast_max_age_windows: float = 1.0  # a forecast this many windows past its own is ignored
    min_instances: int = 0  # per model, however idle: started when missing ([planner] min_instances)
    keep_alive_s: float = 0.0  # an instance idle for less than this is never stopped ([planner] keep_alive)
    saturation: SaturationParams | None = None  # also start one more on measured saturation (None: off)
    scaler: AutoscaleParams | None = None  # None: the public code's, with B = batch_size
    start_seen_timeout_s: float = 30.0  # an applied start whose instance the stats never list is dropped then

    def __post_init__(self) -> None:
        if self.keep_alive_s < 0:
            raise ValueError(f"need keep_alive_s >= 0, got {self.keep_alive_s}")
        if self.batch_size < 1 or self.mean_request_s <= 0 or not 0 < self.prewarm_fraction <= 1:
            raise ValueError("need batch_size >= 1, mean_request_s > 0, 0 < prewarm_fraction <= 1")
        if self.load_bytes_per_s <= 0 or self.min_instances < 0:
            raise ValueError("need load_bytes_per_s > 0 and min_instances >= 0")

    @property
    def autoscale(self) -> AutoscaleParams:
        return self.scaler or AutoscaleParams(batch_size=self.batch_size)


class WarmServePolicy:
    name = "warmserve"

    def __init__(self, settings: WarmServeSettings = WarmServeSettings(), *,
                 capacity: ScaleUpPolicy | None = None) -> None:
        self.s = settings
        self.params = settings.autoscale
        self.capacity = capacity  # the capacity-request path: its starts in flight count here too
        self.starts = capacity.tracker if capacity is not None else StartTracker(settings.start_seen_timeout_s)
        costs = self.starts.costs  # shared with the capacity path: its rates and loads rank both paths' workers
        costs.default_bytes_per_s, costs.request_s = settings.load_bytes_per_s, settings.mean_request_s
        costs.horizon_s = self.params.window_s
        self.demand_settings = DemandSettings(settings.batch_size, settings.mean_request_s, settings.load_bytes_per_s,
                                              settings.prewarm_fraction)
        self.pending_prewarm: dict[tuple[str, str], int] = {}  # (worker, model) -> bytes, in flight
        self.loads: dict[str, LoadWindow] = {}  # model -> its requests in the system over time
        self.first_seen: dict[str, float] = {}  # instance -> when the view first had it
        self.last_busy: dict[str, float] = {}  # instance -> when it last held a request (keep-alive)
        self.saturation = SaturationMonitor(settings.saturation) if settings.saturation is not None else None
        self.counts: Counter[str] = Counter()  # scale_up_warm, scale_up_cold, scale_down, prewarm, release

    # --- the Policy protocol ----------------------------------------------------------------
    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        workers = view.usable_workers()
        lives = {w.worker_id: lifecycle_of(w) for w in workers}
        self._age(view, workers)
        self.starts.refresh(view)
        decisions: list[Decision] = []
        taken: set[str] = set()  # workers given an instance this interval: no prewarm there
        for model in sorted(view.models):
            decisions += self._autoscale(view, model, workers, lives, taken, busy)
        if self.s.prewarm:
            demands = []
            for model, fc in current_forecasts(view, self.s.forecast_max_age_windows).items():
                active = [i for w in workers for i in w.instances if i.model == model and i.accepting]
                demands.append(demand(view.models[model], fc, len(active), self.demand_settings))
            decisions += self._prewarms(view, demands, workers, lives, taken, busy)
        return decisions

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        action = action_of(effect)
        if isinstance(action, PlacePrewarm):
            self.pending_prewarm.pop((action.worker_id, action.model), None)
        elif isinstance(action, ScaleUp):
            self.starts.ended(action, outcome)

    def on_declined(self, decision: Decision, why: str) -> None:
        """The memory arbiter did not buy a start (`[planner] economy = "arbiter"`): it is not starting."""
        if isinstance(decision.action, ScaleUp):
            self.starts.ended(decision.action, PlanCancelled(plan_id="declined", ts=0.0, message=why[:2000]))

    # --- instances ------------------------------------------------------------------------
    def _age(self, view: ClusterView, workers: list[WorkerView]) -> None:
        present = {i.instance_id for w in workers for i in w.instances}
        for iid in present:
            self.first_seen.setdefault(iid, view.now)
        for iid in set(self.first_seen) - present:
            del self.first_seen[iid]
            self.last_busy.pop(iid, None)
        for w in workers:
            for i in w.instances:
                if i.running or i.waiting or i.requests:
                    self.last_busy[i.instance_id] = view.now
                else:
                    self.last_busy.setdefault(i.instance_id, self.first_seen[i.instance_id])

    def _autoscale(self, view: ClusterView, model: str, workers: list[WorkerView], lives: dict[str, WorkerLife],
                   taken: set[str], busy: Busy) -> list[Decision]:
        mine = [i for w in workers for i in w.instances if i.model == model]
        queued = view.queued.get(model, 0)
        now_load = sum(i.running + i.waiting for i in mine) + queued
        window = self.loads.get(model)
        if window is None:
            if not now_load and not mine and not self.s.min_instances:
                return []  # never had load nor an instance: nothing to keep a window for
            window = self.loads[model] = LoadWindow(self.params.window_s)
        window.record(view.now, now_load)
        load = window.mean(view.now)
        accepting = [i for i in mine if i.accepting]
        self.starts.costs.model_load[model] = load / len(accepting) if accepting else 0.0
        kept = self.s.keep_alive_s
        members = [Member(i.instance_id, self.first_seen.get(i.instance_id, view.now), i.running + i.waiting,
                          stoppable=not (i.running or i.waiting or i.requests)
                          and view.now - self.last_busy.get(i.instance_id, view.now) >= kept) for i in accepting]
        starting = self.starts.count(model)
        d = autoscale(load, members, starting, view.now, self.params)
        starts, why = d.start, (
            f"load {load:.1f} (avg over {self.params.window_s:g}s; {now_load} now, {queued} queued) > "
            f"{self.params.scale_up_at:g} x {d.capacity} (B={self.params.batch_size} x {len(accepting)} serving + "
            f"{starting} starting)")
        saturated = self._saturated(view, model, accepting, queued)
        if not starts and saturated and not starting:
            starts, why = 1, f"saturated: {saturated}"
        if not starts and len(accepting) + starting < self.s.min_instances:
            starts = self.s.min_instances - len(accepting) - starting
            why = f"{len(accepting)} serving + {starting} starting < min_instances {self.s.min_instances}"
        out: list[Decision] = []
        for _ in range(starts):
            worker = self._scale_up_worker(view, model, workers, lives, taken)
            if worker is None:
                break
            action = ScaleUp(model=model, worker_id=worker.worker_id,
                             instance_id=scale_up_instance_id(worker.worker_id, model, int(view.now)))
            if busy.has(key(action)):
                break
            warm = worker.prewarmed.get(model, 0)
            self.counts["scale_up_warm" if warm else "scale_up_cold"] += 1
            self.starts.add(action, "", view.now, max(0, view.models[model].weight_bytes - warm))
            taken.add(worker.worker_id)
            # trigger: the autoscaler asks for capacity, as a dispatcher's capacity request does (PlanTrigger has
            # no "load"); the reason says which
            out.append(Decision(action=action, trigger="capacity_request", ttl_s=SCALE_UP_TTL_S, reason=(
                f"autoscaler: {model}: {why}; {worker.worker_id} " + (f"holds {warm} B warm" if warm else "starts it cold"))))
        # a sibling with requests waiting is the model's load queued at a worker instead of the dispatcher: an
        # idle instance then is one routing has not reached yet, not a surplus (draining it flaps: the next
        # saturation sample starts it again)
        if queued or saturated or not d.stop or any(i.waiting for i in accepting):
            return out
        keep = max(0, len(accepting) - self.s.min_instances)
        by_id = {i.instance_id: i for i in accepting}
        for iid in d.stop[:keep]:
            inst = by_id[iid]
            action = ScaleDown(instance_id=iid, worker_id=inst.worker_id, model=model)
            if busy.has(key(action)):
                continue
            self.counts["scale_down"] += 1
            out.append(Decision(action=action, trigger="idle", reason=(
                f"autoscaler: {model}: load {load:.1f} (avg over {self.params.window_s:g}s) < {self.params.scale_down_at:g} x "
                f"{d.capacity}; {iid} (idle for {kept:g}s or more, older than {self.params.protect_s:g}s) drains, its "
                f"weights stay warm")))
        return out

    def _saturated(self, view: ClusterView, model: str, accepting: list, queued: int) -> str | None:
        """Why the model's serving instances are saturated by measure (shared/policy/saturation.py), or None."""
        if self.saturation is None:
            return None
        loads = [InstanceLoad(i.running, i.waiting, i.tokens_per_s) for i in accepting]
        self.saturation.observe(model, view.now, loads, queued)
        return self.saturation.verdict(model, view.now)

    def _scale_up_worker(self, view: ClusterView, model: str, workers: list[WorkerView],
                         lives: dict[str, WorkerLife], taken: set[str]) -> WorkerView | None:
        need = view.models[model].weight_bytes
        starting = self.starts.workers(model)
        best: tuple[tuple[float, int, bool, int, int, str], WorkerView] | None = None
        for w in workers:
            if w.worker_id in taken or w.worker_id in starting or any(i.model == model for i in w.instances):
                continue
            room = room_bytes(w)  # free + every warm byte (given up for an instance) + unused KV
            if room < need:
                continue
            others = sum(b for m, b in w.prewarmed.items() if m != model)  # what dedication evicts
            # the soonest to serve (start_cost.py: a warm worker whose other models queue more than the cold
            # start it saves is passed over), then the most warm, universal before dedicated, least to evict
            rank = (self.starts.costs.wait_s(w, model, need), -w.prewarmed.get(model, 0),
                    lives[w.worker_id].role is WorkerRole.DEDICATED, others, -room, w.worker_id)
            if best is None or rank < best[0]:
                best = (rank, w)
        return None if best is None else best[1]

    # --- prewarming (Alg. 1) ----------------------------------------------------------------
    def _prewarms(self, view: ClusterView, demands: list[ModelDemand], workers: list[WorkerView],
                  lives: dict[str, WorkerLife], taken: set[str], busy: Busy) -> list[Decision]:
        full = {d.model: prewarm_replicas(d) for d in demands}
        existing = existing_replicas(view, workers, full, self.pending_prewarm)
        held: Counter[str] = Counter(r.model for r in existing)
        reduced = [ModelDemand(d.model, d.size_bytes, d.parallel, d.batch_size,
                               d.active + self.starts.count(d.model) + held[d.model], d.avg_load,
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
