"""The fleet simulator: many models on a GPU cluster whose instances come and go (WarmServe §7).

Discrete-event, no wall clock. Arrivals wait in a per-model queue (the wait counts in TTFT)
and go to the ready instance with the fewest outstanding requests below its batch size B.
Each instance is a SimWorker engine (continuous batching, KV blocks) with the model's step
costs on its GPUs (loadgen/sim/fleet_profile.py).

Autoscaler (SLLM-GPU and WarmServe alike, §2.1): a model needs ceil(demand / B) instances,
demand = queued + outstanding on its non-draining instances. Short of that, it scales up
(loadgen/sim/fleet_scaling.py): cancel a draining instance's grace period, else a prewarm
*hit*, else a *partial* (a replica still loading), else a *cold* start. An instance above the
need for keep_alive_s enters its grace period (no new requests) and is released when it
drains; with `cache_on_release` its weights stay on its GPUs as a replica. WarmServe's
prewarm planner (loadgen/sim/fleet_prewarm.py) places replicas from the forecasts.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from loadgen.sim.fleet_prewarm import Prewarmer
from loadgen.sim.fleet_profile import FleetProfile
from loadgen.sim.fleet_scaling import scale_up
from loadgen.sim.fleet_state import FleetSystem, GpuState, Instance, Replica
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker
from loadgen.traces.schema import Trace
from shared.policy.warmserve_predictor import LoadForecast

STEP, READY, TICK, WINDOW = 0, 1, 2, 3


@dataclass
class FleetResult:
    system: str
    model: np.ndarray  # per request: index into `models`
    models: list[str]
    ttft: np.ndarray  # seconds (NaN: never got a token)
    tpot: np.ndarray  # seconds per output token after the first (NaN: one token)
    starts: dict[str, int]  # instance starts by kind: hit, partial, cold, ungrace
    prewarms: int  # replicas placed by the prewarm planner
    proactive: int  # of them, into grace-period instances' KV
    evicted: int  # replicas evicted (by placements or by dedications)
    timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # model -> (t, instances)

    @property
    def hit_rate(self) -> float:
        """Prewarm hits over instance creations (a cancelled grace period creates none)."""
        made = self.starts["hit"] + self.starts["partial"] + self.starts["cold"]
        return self.starts["hit"] / made if made else 1.0


class FleetSim:
    def __init__(self, profile: FleetProfile, trace: Trace, system: FleetSystem, *,
                 forecasts: dict[str, list[LoadForecast]] | None = None, window_s: float = 300.0,
                 initial: dict[str, int] | None = None, max_run_s: float = 0.5) -> None:
        self.profile, self.trace, self.system = profile, trace, system
        self.models = {m.name: m for m in profile.models}
        unknown = sorted({r.model for r in trace.records} - self.models.keys())
        if unknown:
            raise ValueError(f"trace names models the profile {profile.name!r} lacks: {unknown}")
        self.gpus = [GpuState(i, i // profile.gpus_per_server) for i in range(profile.gpus)]
        self.instances: dict[str, list[Instance]] = {m: [] for m in self.models}
        self.queues: dict[str, deque[SimRequest]] = {m: deque() for m in self.models}
        self.replicas: list[Replica] = []
        self.forecasts = forecasts or {}
        self.window_s, self.window = window_s, 0
        self.max_run_s = max_run_s
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = itertools.count()
        self.ids = itertools.count()
        self.need_seen: dict[str, dict[int, float]] = {m: {} for m in self.models}
        self.starts = {"hit": 0, "partial": 0, "cold": 0, "ungrace": 0}
        self.prewarms = self.proactive = self.evicted = 0
        self.dirty = True  # the prewarm planner should run at the next tick
        self.timeline: dict[str, list[tuple[float, int]]] = {m: [] for m in self.models}
        self.prewarmer = Prewarmer(self) if system.prewarm != "none" else None
        for s in system.static:
            m = self.models[s.model]
            cost = profile.step_cost(m, tp=len(s.gpus), share=s.share)
            self._new_instance(s.model, s.gpus, 0.0, "static", cost=cost,
                               spec=profile.worker_spec(m, kv_blocks=s.kv_blocks, max_batch=s.max_batch), own=False)
        for name, n in (initial or {}).items():
            for _ in range(n):
                if not scale_up(self, name, 0.0, initial=True):
                    raise ValueError(f"no room for the initial instances of {name}")

    # --- instances -----------------------------------------------------------------------
    def _new_instance(self, model: str, gpus: tuple[int, ...], ready_at: float, start: str, *, cost=None,
                      spec=None, own: bool = True) -> Instance:
        m = self.models[model]
        spec = spec or self.profile.worker_spec(m)
        iid = next(self.ids)
        engine = SimWorker(iid, f"i{iid}", model, spec, cost or self.profile.step_cost(m), self.max_run_s)
        inst = Instance(iid, model, gpus, engine, ready_at, start, kv_blocks=spec.kv_blocks)
        self.instances[model].append(inst)
        if own:
            for g in gpus:
                self.gpus[g].instance = inst
        heappush(self.heap, (ready_at, next(self.seq), READY, inst, 0))
        self.dirty = True
        return inst

    def evict(self, replica: Replica) -> None:
        """Drop a replica from all its GPUs (a partial prewarm cannot start an instance)."""
        if replica in self.replicas:
            self.replicas.remove(replica)
            for g in replica.gpus:
                self.gpus[g].replicas.remove(replica)
            self.evicted += 1
            self.dirty = True

    def add_replica(self, replica: Replica) -> None:
        self.replicas.append(replica)
        for g in replica.gpus:
            self.gpus[g].replicas.append(replica)
        self.dirty = True

    def dedicate(self, model: str, gpus: tuple[int, ...], ready_at: float, start: str) -> Instance:
        for r in {r for g in gpus for r in self.gpus[g].replicas}:
            self.evict(r)  # the new instance takes these GPUs whole: other weights go
        if start != "initial":
            self.starts[start] += 1
        return self._new_instance(model, gpus, ready_at, start)

    def ungrace(self, inst: Instance) -> None:
        inst.grace = False
        for r in [r for g in inst.gpus for r in self.gpus[g].replicas]:
            self.evict(r)  # proactive prewarms give the KV back
        inst.engine.total += inst.kv_lent_blocks
        inst.kv_lent_blocks = 0
        self.starts["ungrace"] += 1

    def _begin_grace(self, inst: Instance, now: float) -> None:
        inst.grace = True
        self.dirty = True
        if inst.outstanding == 0:
            self._release(inst, now)

    def _release(self, inst: Instance, now: float) -> None:
        self.instances[inst.model].remove(inst)
        for g in inst.gpus:
            self.gpus[g].instance = None
            for r in self.gpus[g].replicas:
                r.proactive = False  # now on a universal worker
        if self.system.cache_on_release:
            m = self.models[inst.model]
            self.add_replica(Replica(inst.model, inst.gpus, self.profile.weights_per_gpu(m), now))
        self.dirty = True
        for model, q in self.queues.items():
            if q:
                self._autoscale(model, now)

    # --- requests ------------------------------------------------------------------------
    def _send(self, inst: Instance, req: SimRequest, now: float) -> None:
        inst.outstanding += 1
        end = inst.engine.enqueue(req, now)
        if end is not None:
            heappush(self.heap, (end, next(self.seq), STEP, inst, inst.engine.gen))
        self._collect(inst)

    def _collect(self, inst: Instance) -> None:
        fin = inst.engine.finished
        if fin:
            inst.outstanding -= len(fin)
            self.done += len(fin)
            fin.clear()

    def _pump(self, model: str, now: float) -> None:
        q = self.queues[model]
        if not q:
            return
        live = [i for i in self.instances[model] if not i.grace and i.ready_at <= now]
        while q and live:
            best = min(live, key=lambda i: i.outstanding)
            if best.outstanding >= best.engine.spec.max_batch:
                break
            self._send(best, q.popleft(), now)

    def _need(self, model: str) -> tuple[int, int]:
        """(instances needed, non-draining instances)."""
        live = [i for i in self.instances[model] if not i.grace]
        demand = len(self.queues[model]) + sum(i.outstanding for i in live)
        return math.ceil(demand / self.models[model].batch_size), len(live)

    def _autoscale(self, model: str, now: float) -> None:
        need, have = self._need(model)
        while have < need and scale_up(self, model, now):
            have += 1
        self._pump(model, now)

    def _scale_down(self, model: str, now: float) -> None:
        need, _ = self._need(model)
        seen = self.need_seen[model]
        for k in range(1, need + 1):
            seen[k] = now
        ready = [i for i in self.instances[model] if not i.grace and i.ready_at <= now]
        n = len([i for i in self.instances[model] if not i.grace])
        while ready and n > need and now - seen.get(n, 0.0) >= self.system.keep_alive_s:
            inst = min(ready, key=lambda i: (i.outstanding, -i.id))
            ready.remove(inst)
            self._begin_grace(inst, now)
            n -= 1

    # --- the event loop ------------------------------------------------------------------
    def run(self) -> FleetResult:
        recs = self.trace.records
        n = len(recs)
        reqs: list[SimRequest] = []
        self.done = 0
        heap = self.heap
        heappush(heap, (0.0, next(self.seq), TICK, None, 0))
        windows = max((len(f) for f in self.forecasts.values()), default=0)
        for w in range(windows):
            heappush(heap, (w * self.window_s, next(self.seq), WINDOW, None, w))
        i, inf = 0, float("inf")
        while i < n or self.done < n:
            t_arr = recs[i].arrival_s if i < n else inf
            if i >= n and not heap:
                break  # nothing left can happen: the rest never got an instance
            if heap and heap[0][0] <= t_arr:
                t, _, kind, obj, gen = heappop(heap)
                if kind == STEP:
                    inst: Instance = obj  # type: ignore[assignment]
                    eng = inst.engine
                    if gen != eng.gen:
                        continue
                    eng.complete(t)
                    self._collect(inst)
                    end = eng.plan(t)
                    if end is not None:
                        heappush(heap, (end, next(self.seq), STEP, inst, eng.gen))
                    self._collect(inst)
                    if inst.grace:
                        self.dirty = True  # its KV surplus grew (Eq. 1 is re-checked per finished request)
                        if inst.outstanding == 0:
                            self._release(inst, t)
                    else:
                        self._pump(inst.model, t)
                elif kind == READY:
                    self._pump(obj.model, t)  # type: ignore[union-attr]
                elif kind == WINDOW:
                    self.window, self.dirty = gen, True
                else:
                    self._tick(t, more=i < n)
                continue
            rec = recs[i]
            m = self.models[rec.model]
            prompt = min(rec.prompt_tokens, m.max_model_len - 1)
            req = SimRequest(i, rec.request_id or f"req-{i}", rec.model, None, rec.arrival_s, prompt,
                             max(1, min(rec.output_tokens, m.max_model_len - prompt)))
            reqs.append(req)
            i += 1
            self.queues[rec.model].append(req)
            self._pump(rec.model, t_arr)
            if self.queues[rec.model] and self.system.autoscale:
                self._autoscale(rec.model, t_arr)
        return self._result(reqs)

    def _tick(self, t: float, more: bool) -> None:
        if self.system.autoscale:
            for model in self.models:
                if self.queues[model]:
                    self._autoscale(model, t)
                self._scale_down(model, t)
        if self.prewarmer is not None and self.dirty:
            self.dirty = False
            self.prewarmer.plan(t)
        for model, insts in self.instances.items():
            tl = self.timeline[model]
            if not tl or tl[-1][1] != len(insts):
                tl.append((t, len(insts)))
        if more or any(self.queues.values()) or any(i.outstanding for v in self.instances.values() for i in v):
            heappush(self.heap, (t + self.system.tick_s, next(self.seq), TICK, None, 0))

    def _result(self, reqs: list[SimRequest]) -> FleetResult:
        names = list(self.models)
        idx = {m: k for k, m in enumerate(names)}
        ok = [r.status == "ok" and r.first_token >= 0 for r in reqs]
        ttft = np.array([r.first_token - r.arrival if good else np.nan for r, good in zip(reqs, ok)])
        tpot = np.array([(r.finish - r.first_token) / (r.output - 1) if good and r.output > 1 else np.nan
                         for r, good in zip(reqs, ok)])
        return FleetResult(self.system.name, np.array([idx[r.model] for r in reqs], dtype=np.int64), names,
                           ttft, tpot, dict(self.starts), self.prewarms, self.proactive, self.evicted,
                           self.timeline)
