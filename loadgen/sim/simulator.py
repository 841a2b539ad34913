"""The discrete-event simulator: N workers, a routing policy, a trace.

Time is float seconds on a heapq event queue; there is no wall clock. Arrivals are read
in order from the trace (never all pushed on the heap); each worker has at most one
pending step event (a stale one is recognised by its generation number and skipped).
At each arrival the simulator builds `RequestView` / `InstanceView` values and calls
`shared.policy.routing.RoutingPolicy.choose` exactly as the live dispatcher does, on the
instances the same admission gate lets through for an adapter request
(`shared.policy.admission.serving` with the policy's `adapter_gate`); an instance's view is refreshed from its worker's state at the worker's last step
boundary, like the dispatcher's view from the last worker stats.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from heapq import heappop, heappush

import msgspec

from loadgen.report.records import MemorySample, RequestRecord
from loadgen.sim.profile import CostProfile
from loadgen.sim.request import SimRequest
from loadgen.sim.scale_out import ScaleEvent, ScaleOut
from loadgen.sim.timeline import OccupancySample, WorkerTimeline
from loadgen.sim.worker import SimWorker
from loadgen.traces.schema import Trace
from shared.policy.admission import adapter_gate, serving
from shared.policy.routing import InstanceView, RequestView, RoutingPolicy


class SimStats(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    finishes: int  # finish events collected; equals `requests` when each finished exactly once
    events: int  # step events processed (stale ones excluded)
    steps: int  # engine steps simulated (a k-step decode run counts k)
    preemptions: int
    adapter_loads: int
    sim_end_s: float
    wall_s: float


class SimResult(msgspec.Struct, kw_only=True):
    records: list[RequestRecord]
    memory: list[MemorySample]
    stats: SimStats
    placement: dict[str, str]  # worker id -> model
    occupancy: dict[str, list[OccupancySample]] = {}  # worker id -> its engine over time (when asked for)
    scale_outs: list[ScaleEvent] = []  # with a ScaleOut: each start, when decided and when serving


def place_models(counts: dict[str, int], workers: int) -> list[str]:
    """Workers per model in proportion to its requests (largest remainder), at least one each."""
    models = sorted(counts)
    if workers < len(models):
        raise ValueError(f"{workers} workers cannot serve {len(models)} models (one instance per worker)")
    total = sum(counts.values()) or 1
    quota = {m: workers * counts[m] / total for m in models}
    share = {m: max(1, int(quota[m])) for m in models}
    while sum(share.values()) > workers:  # the minimum of one pushed us over: take from the most over quota
        m = max((m for m in models if share[m] > 1), key=lambda m: (share[m] - quota[m], m))
        share[m] -= 1
    while sum(share.values()) < workers:
        m = max(models, key=lambda m: (quota[m] - share[m], m))
        share[m] += 1
    return [m for m in models for _ in range(share[m])]


class Simulator:
    def __init__(self, trace: Trace, profile: CostProfile, workers: int, policy: RoutingPolicy, *,
                 max_run_s: float = 0.5, sample_interval_s: float | None = None,
                 placement: list[str] | None = None, check_invariants: bool = False,
                 make_worker: Callable[..., SimWorker] | None = None,
                 occupancy_interval_s: float | None = None, scale_out: ScaleOut | None = None) -> None:
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        self.trace = trace
        self.profile = profile
        self.policy = policy
        self.check_invariants = check_invariants
        counts: dict[str, int] = {}
        for r in trace.records:
            counts[r.model] = counts.get(r.model, 0) + 1
        models = placement or place_models(counts or {"model-0": 1}, workers)
        if len(models) != workers:
            raise ValueError(f"placement names {len(models)} models for {workers} workers")
        width = len(str(workers - 1))
        make = make_worker or SimWorker  # a subclass (or factory) with the same arguments, e.g. LoRA step costs
        self.workers = [make(i, f"w{i:0{width}d}", m, profile.worker, profile.step_cost(m), max_run_s)
                        for i, m in enumerate(models)]
        self.by_instance = {w.instance_id: w for w in self.workers}
        self.scale_out = scale_out  # None: every worker serves from time 0
        self.standby = scale_out.standby(self.workers) if scale_out is not None else set()
        if occupancy_interval_s is not None:  # KV occupancy, preemptions, waiting for memory vs compute
            for w in self.workers:
                w.timeline = WorkerTimeline(occupancy_interval_s)
        self._adapter_sets: dict[int, tuple[int, frozenset[str]]] = {}
        self.ranks = {a.name: a.rank for a in trace.header.adapters}  # views carry batch ranks when known
        self.views: dict[str, list[InstanceView]] = {}
        self.view_pos: dict[int, int] = {}
        for w in self.workers:
            lst = self.views.setdefault(w.model, [])
            if w.index not in self.standby:
                self.view_pos[w.index] = len(lst)
                lst.append(self._view(w))
        self.dirty: dict[str, set[SimWorker]] = {m: set() for m in self.views}
        duration = trace.header.duration_s or (trace.records[-1].arrival_s if trace.records else 1.0)
        self.sample_interval = sample_interval_s or max(duration / 400, 1e-3)
        self.memory: list[MemorySample] = []

    def activate(self, w: SimWorker) -> None:
        """A standby worker's instance serves from now: the routing policy sees it."""
        self.standby.discard(w.index)
        lst = self.views[w.model]
        self.view_pos[w.index] = len(lst)
        lst.append(self._view(w))

    def _view(self, w: SimWorker) -> InstanceView:
        cached = self._adapter_sets.get(w.index)
        if cached is None or cached[0] != w.adapter_loads:  # the set changes only when an adapter loads
            cached = (w.adapter_loads, frozenset(w.adapters))
            self._adapter_sets[w.index] = cached
        return InstanceView(
            instance_id=w.instance_id, worker_id=w.worker_id, model=w.model, live=True, kv_blocks_used=w.used,
            kv_blocks_total=w.total, block_size=w.bs, queued_prompt_tokens=w.queued_tokens,
            running_requests=w.decoding + len(w.prefilling), waiting_requests=len(w.waiting),
            resident_adapters=cached[1], max_batch=w.spec.max_batch, **self._ranks(w))

    def _ranks(self, w: SimWorker) -> dict[str, tuple[int, ...]]:
        """The LoRA ranks of the worker's batch and queue, as the dispatcher reads them from stats."""
        rk = self.ranks
        if not rk:
            return {}
        running = [rk.get(e[3].adapter, 0) for e in w.heap if e[2] == e[3].epoch]
        running += [rk.get(r.adapter, 0) for r in w.prefilling]
        return {"running_ranks": tuple(running), "waiting_ranks": tuple(rk.get(r.adapter, 0) for r in w.waiting)}

    def _sample(self, t: float) -> None:
        kv_bytes = self.profile.worker.kv_bytes_per_token * self.profile.worker.block_size
        for w in self.workers:
            self.memory.append(MemorySample(t_s=t, worker=w.worker_id, kind="kv", bytes=w.used * kv_bytes))

    def run(self) -> SimResult:
        started = time.perf_counter()
        spec = self.profile.worker
        for w in self.workers:
            self.memory.append(MemorySample(t_s=0.0, worker=w.worker_id, kind="weights", bytes=spec.weights_bytes))
        records = self.trace.records
        n = len(records)
        overhead = self.profile.request_overhead_s
        requests: list[SimRequest] = []
        heap: list[tuple[float, int, int, int]] = []
        counter = itertools.count()
        workers, views, dirty, view_pos = self.workers, self.views, self.dirty, self.view_pos
        choose, gate = self.policy.choose, adapter_gate(self.policy)
        check = self.check_invariants
        next_sample, interval = 0.0, self.sample_interval
        finishes = events = 0
        inf = float("inf")
        arrivals = [r.arrival_s + overhead for r in records]
        arrivals.append(inf)
        i = 0
        scaler = self.scale_out
        while True:
            t_arr = arrivals[i]
            if scaler is not None and (i < n or heap) and scaler.next_s <= min(t_arr, heap[0][0] if heap else inf):
                scaler.tick(self, scaler.next_s)
                continue
            if heap and heap[0][0] <= t_arr:
                t, _, widx, gen = heappop(heap)
                w = workers[widx]
                if gen != w.gen:
                    continue
                while next_sample <= t:
                    self._sample(next_sample)
                    next_sample += interval
                events += 1
                w.complete(t)
                if check:
                    w.check()
                if w.finished:
                    finishes += len(w.finished)
                    w.finished.clear()
                end = w.plan(t)
                if end is not None:
                    heappush(heap, (end, next(counter), widx, w.gen))
                if w.finished:
                    finishes += len(w.finished)
                    w.finished.clear()
                dirty[w.model].add(w)
                continue
            if i >= n:
                break
            while next_sample <= t_arr:
                self._sample(next_sample)
                next_sample += interval
            rec = records[i]
            req = SimRequest(i, rec.request_id or f"req-{i}", rec.model, rec.adapter, rec.arrival_s,
                             rec.prompt_tokens, rec.output_tokens)
            requests.append(req)
            i += 1
            if req.prompt > spec.max_model_len:
                req.status, req.finish = "error", t_arr
                req.error = f"prompt of {req.prompt} tokens exceeds the context length {spec.max_model_len}"
                finishes += 1
                continue
            req.output = max(1, min(req.output, spec.max_model_len - req.prompt))
            model_views = views.get(req.model)
            if model_views is None:
                req.status, req.finish, req.error = "rejected", t_arr, f"no instance serves {req.model}"
                finishes += 1
                continue
            stale = dirty[req.model]
            if stale:
                for sw in stale:
                    model_views[view_pos[sw.index]] = self._view(sw)
                stale.clear()
            view = RequestView(request_id=req.request_id, model=req.model, prompt_tokens=req.prompt,
                               max_tokens=req.output, adapter=req.adapter, adapter_rank=self.ranks.get(req.adapter, 0))
            # the live gate (it narrows only adapter requests; the policies filter the rest themselves)
            choice = choose(view, serving(view, model_views, gate) if req.adapter else model_views, t_arr)
            target = self.by_instance.get(choice) if choice is not None else None
            if target is None:
                req.status, req.finish = "rejected", t_arr
                req.error = "no capacity" if choice is None else f"policy chose unknown instance {choice!r}"
                finishes += 1
                continue
            end = target.enqueue(req, t_arr)
            if end is not None:
                heappush(heap, (end, next(counter), target.index, target.gen))
            if target.finished:
                finishes += len(target.finished)
                target.finished.clear()
            stale.add(target)
        sim_end = max((r.finish for r in requests), default=0.0)
        self._sample(sim_end)
        stats = SimStats(
            requests=n, finishes=finishes, events=events, steps=sum(w.steps_run for w in workers),
            preemptions=sum(w.preemptions for w in workers), adapter_loads=sum(w.adapter_loads for w in workers),
            sim_end_s=sim_end, wall_s=time.perf_counter() - started)
        occupancy = {w.worker_id: w.timeline.samples for w in workers if w.timeline is not None}
        return SimResult(records=[_record(r) for r in requests], memory=self.memory, stats=stats,
                         placement={w.worker_id: w.model for w in workers}, occupancy=occupancy,
                         scale_outs=list(scaler.events) if scaler is not None else [])


def _record(r: SimRequest) -> RequestRecord:
    ok = r.status == "ok"
    return RequestRecord(
        request_id=r.request_id, model=r.model, arrival_s=r.arrival, prompt_tokens=r.prompt,
        output_tokens=r.output if ok else r.generated, status=r.status,
        first_token_s=r.first_token if r.first_token >= 0 else None, finish_s=r.finish,
        adapter=r.adapter, worker=r.worker or None, error=r.error)
