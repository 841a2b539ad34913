"""The fleet simulator: many models on a GPU cluster whose instances come and go (WarmServe §7).

Discrete-event, no wall clock. Each instance is a SimWorker engine (continuous batching, KV
blocks) with the model's step costs on its GPUs (loadgen/sim/fleet_profile.py).

Dispatch and autoscaling follow WarmServe's public code (shared/policy/autoscaler.py), the same
for every autoscaling system: an arriving request goes to the model's instance with the fewest
requests below B (one still starting included: the request waits for it); when none has room one
more instance is started at once for it (a direct start), else it waits in the model's queue
(the wait counts in TTFT). Every `period_s` the autoscaler compares the model's requests in the
system, averaged over `window_s`, with B x instances: above 0.8 it starts more, below 0.5 it stops
the least busy ones older than `protect_s` (to zero when idle). A stopped instance takes no new
request and is released when its requests finish; its weights then stay on its GPUs as a
replica (`keep_weights`, charged as prewarm) or are freed. Starts (loadgen/sim/fleet_scaling.py)
come from a prewarmed replica (gpu), one still loading (partial), host memory or storage.
WarmServe's prewarm planner (loadgen/sim/fleet_prewarm.py) places replicas from the forecasts.
"""
from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from loadgen.sim.fleet_prewarm import Prewarmer
from loadgen.sim.fleet_profile import FleetProfile
from loadgen.sim.fleet_scaling import scale_up
from loadgen.sim.fleet_state import START_SOURCES, FleetSystem, GpuState, Instance, Replica
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker
from loadgen.traces.schema import Trace
from shared.policy.autoscaler import LoadWindow, Member, decide
from shared.policy.warmserve_predictor import LoadForecast

STEP, READY, TICK, WINDOW = 0, 1, 2, 3


@dataclass(frozen=True)
class StartRecord:
    id: int  # the instance
    model: str
    source: str  # one of START_SOURCES
    origin: str  # a gpu start: how its replica got there (placed, proactive, kept)
    at: float  # decided
    ready_at: float


@dataclass
class FleetResult:
    system: str
    model: np.ndarray  # per request: index into `models`
    models: list[str]
    ttft: np.ndarray  # seconds (NaN: never got a token)
    tpot: np.ndarray  # seconds per output token after the first (NaN: one token)
    starts: list[StartRecord]  # instance starts after t = 0 (initial and static instances are not starts)
    delayed_by: np.ndarray  # per request: the start it waited for (an index into `starts`), -1: none
    prewarms: int  # replicas placed by the prewarm planner
    proactive: int  # of them, into grace-period instances' KV
    evicted: int  # replicas evicted (by placements or by dedications)
    timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # model -> (t, instances)

    def by_source(self, model: str | None = None) -> dict[str, int]:
        c = Counter(s.source for s in self.starts if model is None or s.model == model)
        return {k: c.get(k, 0) for k in START_SOURCES}

    def hit_origins(self) -> dict[str, int]:
        return dict(Counter(s.origin for s in self.starts if s.source == "gpu"))

    @property
    def hit_rate(self) -> float:
        """Starts on a complete prewarmed replica over all starts (1.0 when nothing started)."""
        return self.by_source()["gpu"] / len(self.starts) if self.starts else 1.0

    def model_hit_rate(self, model: str) -> float:
        src = self.by_source(model)
        n = sum(src.values())
        return src["gpu"] / n if n else 1.0


class FleetSim:
    def __init__(self, profile: FleetProfile, trace: Trace, system: FleetSystem, *,
                 forecasts: dict[str, list[LoadForecast]] | None = None, window_s: float = 300.0,
                 initial: dict[str, int] | None = None, max_run_s: float = 0.5, preload_s: float = 0.0) -> None:
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
        self.load = {m: LoadWindow(system.scaler.window_s) for m in self.models}
        self.in_system = dict.fromkeys(self.models, 0)  # requests arrived and not finished
        self.start_log: list[StartRecord] = []
        self.start_index: dict[int, int] = {}  # instance id -> index into start_log
        self.ready_of: dict[int, float] = {}  # instance id -> when it serves
        self.served_by: list[int] = []  # per request: the instance it was sent to (-1: none)
        self.prewarms = self.proactive = self.evicted = 0
        self.dirty = True  # the prewarm planner should run at the next tick
        self.timeline: dict[str, list[tuple[float, int]]] = {m: [] for m in self.models}
        self.prewarmer = Prewarmer(self) if system.prewarm != "none" else None
        for s in system.static:
            m = self.models[s.model]
            cost = profile.step_cost(m, tp=len(s.gpus), share=s.share)
            self._new_instance(s.model, s.gpus, 0.0, 0.0, 0.0, "static", cost=cost, own=False,
                               spec=profile.worker_spec(m, kv_blocks=s.kv_blocks, max_batch=s.max_batch))
        for name, n in (initial or {}).items():
            for _ in range(n):
                if scale_up(self, name, 0.0, initial=True) is None:
                    raise ValueError(f"no room for the initial instances of {name}")
        if preload_s > 0 and self.prewarmer is not None:
            # the public code's pre-load round: one prewarm plan for the first window, preload_s before t = 0
            self.prewarmer.plan(-preload_s)

    # --- instances -----------------------------------------------------------------------
    def _new_instance(self, model: str, gpus: tuple[int, ...], now: float, ready_at: float, weights_at: float,
                      source: str, *, origin: str = "", cost=None, spec=None, own: bool = True) -> Instance:
        m = self.models[model]
        spec = spec or self.profile.worker_spec(m)
        iid = next(self.ids)
        engine = self._make_engine(iid, model, spec, cost or self.profile.step_cost(m))
        inst = Instance(iid, model, gpus, engine, ready_at, source, started_at=now, weights_at=weights_at,
                        origin=origin, cap=spec.max_batch, kv_blocks=spec.kv_blocks)
        self.instances[model].append(inst)
        self.ready_of[iid] = ready_at
        if own:
            for g in gpus:
                self.gpus[g].instance = inst
        if source in START_SOURCES:
            self.start_index[iid] = len(self.start_log)
            self.start_log.append(StartRecord(iid, model, source, origin, now, ready_at))
        heappush(self.heap, (ready_at, next(self.seq), READY, inst, 0))
        self.dirty = True
        return inst

    def _make_engine(self, iid: int, model: str, spec, cost) -> SimWorker:
        """An instance's engine (a subclass's hook: loadgen/sim/economy.py gives it a memory pool)."""
        return SimWorker(iid, f"i{iid}", model, spec, cost, self.max_run_s)

    def _adapter(self, rec) -> str | None:
        """The adapter a trace record's request runs with (none here: the fleet runs base models)."""
        return None

    def _event(self, kind: int, obj: object, gen: int, t: float) -> None:
        """An event kind of a subclass's own (kinds above WINDOW)."""
        raise ValueError(f"unknown event kind {kind}")

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

    def dedicate(self, model: str, gpus: tuple[int, ...], now: float, ready_at: float, weights_at: float,
                 source: str, origin: str = "") -> Instance:
        for r in {r for g in gpus for r in self.gpus[g].replicas}:
            self.evict(r)  # the new instance takes these GPUs whole: other weights go (its own become its weights)
        return self._new_instance(model, gpus, now, ready_at, weights_at, source, origin=origin)

    def _stop(self, inst: Instance, now: float) -> None:
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
        if self.system.keep_weights:
            m = self.models[inst.model]
            self.add_replica(Replica(inst.model, inst.gpus, self.profile.weights_per_gpu(m), inst.weights_at,
                                     origin="kept"))
        self.dirty = True
        for model, q in self.queues.items():
            if q:
                self._retry(model, now)

    # --- requests ------------------------------------------------------------------------
    def _room(self, model: str) -> Instance | None:
        best = None
        for inst in self.instances[model]:
            if not inst.grace and inst.outstanding < inst.cap and (best is None or inst.outstanding < best.outstanding):
                best = inst
        return best

    def _send(self, inst: Instance, req: SimRequest, now: float) -> None:
        inst.outstanding += 1
        self.served_by[req.order] = inst.id
        if inst.ready_at > now:
            inst.pending.append(req)  # it waits for the instance to start
            return
        end = inst.engine.enqueue(req, now)
        if end is not None:
            heappush(self.heap, (end, next(self.seq), STEP, inst, inst.engine.gen))
        self._collect(inst, now)

    def _collect(self, inst: Instance, now: float) -> None:
        fin = inst.engine.finished
        if fin:
            n = len(fin)
            inst.outstanding -= n
            self.done += n
            fin.clear()
            self.in_system[inst.model] -= n
            self.load[inst.model].record(now, self.in_system[inst.model])

    def _pump(self, model: str, now: float) -> None:
        q = self.queues[model]
        while q:
            inst = self._room(model)
            if inst is None:
                return
            self._send(inst, q.popleft(), now)

    def _retry(self, model: str, now: float) -> None:
        """Queued requests and no instance with room: try a direct start (the public code retries each
        waiting request's `schedule` every second; here at once when GPUs free up, and every period)."""
        self._pump(model, now)
        if self.queues[model] and self.system.autoscale and self._room(model) is None:
            if scale_up(self, model, now) is not None:
                self._pump(model, now)

    def _arrive(self, req: SimRequest, now: float) -> None:
        model = req.model
        self.in_system[model] += 1
        self.load[model].record(now, self.in_system[model])
        q = self.queues[model]
        if q:
            q.append(req)
            self._retry(model, now)
            return
        inst = self._room(model)
        if inst is None and self.system.autoscale:
            inst = scale_up(self, model, now)  # direct start: nothing has room, nothing is starting
        if inst is None:
            q.append(req)
        else:
            self._send(inst, req, now)

    # --- the event loop ------------------------------------------------------------------
    def run(self) -> FleetResult:
        recs = self.trace.records
        n = len(recs)
        reqs: list[SimRequest] = []
        self.served_by = [-1] * n
        self.done = 0
        heap = self.heap
        heappush(heap, (0.0, next(self.seq), TICK, None, 0))
        windows = max((len(f) for f in self.forecasts.values()), default=0)
        for w in range(windows):
            heappush(heap, (w * self.window_s, next(self.seq), WINDOW, None, w))
        i, inf = 0, float("inf")
        horizon = self.trace.header.duration_s  # the autoscaler and the planner run until then at least
        while i < n or self.done < n or (heap and heap[0][0] <= horizon):
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
                    self._collect(inst, t)
                    end = eng.plan(t)
                    if end is not None:
                        heappush(heap, (end, next(self.seq), STEP, inst, eng.gen))
                    self._collect(inst, t)
                    if inst.grace:
                        self.dirty = True  # its KV surplus grew (Eq. 1 is re-checked per finished request)
                        if inst.outstanding == 0:
                            self._release(inst, t)
                    else:
                        self._pump(inst.model, t)
                elif kind == READY:
                    self._ready(obj, t)  # type: ignore[arg-type]
                elif kind == WINDOW:
                    self.window, self.dirty = gen, True
                elif kind == TICK:
                    self._tick(t, more=i < n)
                else:
                    self._event(kind, obj, gen, t)
                continue
            rec = recs[i]
            m = self.models[rec.model]
            prompt = min(rec.prompt_tokens, m.max_model_len - 1)
            req = SimRequest(i, rec.request_id or f"req-{i}", rec.model, self._adapter(rec), rec.arrival_s, prompt,
                             max(1, min(rec.output_tokens, m.max_model_len - prompt)))
            reqs.append(req)
            i += 1
            self._arrive(req, t_arr)
        return self._result(reqs)

    def _ready(self, inst: Instance, t: float) -> None:
        if inst.pending:
            pending, inst.pending = inst.pending, []
            end = None
            for req in pending:
                e = inst.engine.enqueue(req, t)
                end = e if e is not None else end
            if end is not None:
                heappush(self.heap, (end, next(self.seq), STEP, inst, inst.engine.gen))
        self._pump(inst.model, t)

    def _tick(self, t: float, more: bool) -> None:
        p = self.system.scaler
        if self.system.autoscale:
            for model in self.models:
                live = [i for i in self.instances[model] if not i.grace]
                members = [Member(str(i.id), i.started_at, i.outstanding) for i in live]
                d = decide(self.load[model].mean(t), members, 0, t, p)
                for _ in range(d.start):
                    if scale_up(self, model, t) is None:
                        break
                by_id = {str(i.id): i for i in live}
                for iid in d.stop:
                    self._stop(by_id[iid], t)
                self._retry(model, t)
        if self.prewarmer is not None and self.dirty:
            self.dirty = False
            self.prewarmer.plan(t)
        for model, insts in self.instances.items():
            tl = self.timeline[model]
            if not tl or tl[-1][1] != len(insts):
                tl.append((t, len(insts)))
        if more or t + p.period_s <= self.trace.header.duration_s or any(self.queues.values()) or \
                any(i.outstanding for v in self.instances.values() for i in v):
            heappush(self.heap, (t + p.period_s, next(self.seq), TICK, None, 0))

    def _result(self, reqs: list[SimRequest]) -> FleetResult:
        names = list(self.models)
        idx = {m: k for k, m in enumerate(names)}
        ok = [r.status == "ok" and r.first_token >= 0 for r in reqs]
        ttft = np.array([r.first_token - r.arrival if good else np.nan for r, good in zip(reqs, ok)])
        tpot = np.array([(r.finish - r.first_token) / (r.output - 1) if good and r.output > 1 else np.nan
                         for r, good in zip(reqs, ok)])
        delayed = np.full(len(reqs), -1, dtype=np.int64)
        for r in reqs:
            iid = self.served_by[r.order]
            k = self.start_index.get(iid)
            if k is not None and r.arrival < self.ready_of[iid]:
                delayed[r.order] = k  # it arrived before its instance could serve: it waited for that start
        return FleetResult(self.system.name, np.array([idx[r.model] for r in reqs], dtype=np.int64), names,
                           ttft, tpot, list(self.start_log), delayed, self.prewarms, self.proactive, self.evicted,
                           self.timeline)
