"""The economy simulator: the fleet simulator (loadgen/sim/fleet.py: many models, WarmServe's public
autoscaler, prewarm planner) where every instance's device memory is one pool (economy_state.py) and
the arms buy memory from its sources by their own triggers or by price. `EconomySim` composes three
layers: the sources' offers and prices (economy_pricing.py, read-only), the arbiter and the mechanisms'
own triggers that choose among them (economy_arbiter.py), and the executor that carries out what is
bought (economy_execution.py, the only one that changes the fleet). Every arm shares the base: the
public autoscaler, vLLM-0.6 engines (recompute preemption when KV runs out), WarmServe's prewarm planner,
CaraServe's CPU-assisted cold adapters, weights kept as a replica after a stop.

    python -m loadgen.sim.economy --arm arbiter --minutes 10 --rate 10
"""
from __future__ import annotations

import argparse
import math
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, replace
from heapq import heappush

import msgspec
import numpy as np

from loadgen.sim.economy_arbiter import EconomyArbiter
from loadgen.sim.economy_execution import MOVE, RESTORED, Move, OfferExecutor, lent_blocks
from loadgen.sim.economy_pricing import SourcePricer
from loadgen.sim.economy_profile import EconomyProfile, load_economy_profile, with_models
from loadgen.sim.economy_result import ARMS, EconomyResult, PoolSample, PurchaseRecord
from loadgen.sim.economy_state import ABLATIONS, ARM_CONFIGS, UNBOUNDED_BLOCKS, EconomyWorker, Pool
from loadgen.sim.fleet import STEP, FleetSim
from loadgen.sim.fleet_scaling import scale_up
from loadgen.sim.fleet_state import FleetSystem, Instance, Replica
from loadgen.sim.request import SimRequest
from loadgen.traces.schema import Trace
from shared.policy.warmserve_predictor import CspParams, LoadForecast, forecast

ECON_TICK, SAMPLE = 4, 5


@dataclass(frozen=True)
class EconomyForecasts:
    per_model: dict[str, list[LoadForecast]]  # each window of the run
    window_s: float


class EconomySim(FleetSim):
    def __init__(self, eprofile: EconomyProfile, trace: Trace, arm: str, *, gpus: int | None = None,
                 forecasts: EconomyForecasts | dict[str, list[LoadForecast]] | None = None,
                 sample_interval_s: float = 5.0, max_run_s: float = 0.5,
                 slo: tuple[float, float] = (5.0, 1.0)) -> None:
        config = ARM_CONFIGS.get(arm) or ABLATIONS.get(arm)
        if config is None:
            raise ValueError(f"unknown arm {arm!r}; choose from {', '.join((*ARMS, *ABLATIONS))}")
        spec = eprofile.spec
        self.eprofile, self.arm = eprofile, config
        self.horizon_s = spec.horizon_s
        # the TTFT SLO the prices read (max(scale x unloaded TTFT, floor), as the evaluation): a wait counts past it
        if not (slo[0] > 0 and slo[1] >= 0):
            raise ValueError(f"economy sim: the SLO needs scale > 0 and floor >= 0, got {slo}")
        self.ranks = {a.name: a.rank for a in trace.header.adapters}
        self.arrivals: dict[str, deque[float]] = defaultdict(deque)
        self.arrived: dict[str, list[float]] = defaultdict(list)  # every arrival of each model (for `rate_over`)
        # each model's arrivals' KV demand: (arrival, prompt + output tokens, capped at the context length)
        self.arrival_tokens: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self.freed: dict[int, deque[tuple[float, int]]] = defaultdict(deque)
        self.group_of: dict[int, Instance] = {}
        self.moving: dict[int, Move] = {}
        self.by_id: dict[int, Instance] = {}
        self.base_cost: dict = {}
        self.engines: list[EconomyWorker] = []
        self.purchases: list[PurchaseRecord] = []
        self.pool_samples: list[PoolSample] = []
        self.counts: Counter[str] = Counter()
        self.ttft_extra: dict[int, float] = {}
        self.bought_starts: set[int] = set()
        self.sample_interval_s = sample_interval_s
        fleet = eprofile.fleet
        n_gpus = gpus or fleet.gpus
        if n_gpus > fleet.gpus:
            fleet = msgspec.structs.replace(fleet, servers=math.ceil(n_gpus / fleet.gpus_per_server))
        self.moves = fleet.movement_costs()
        window_s = 300.0
        if isinstance(forecasts, EconomyForecasts):
            forecasts, window_s = forecasts.per_model, forecasts.window_s
        super().__init__(fleet, trace, FleetSystem(arm, prewarm=self.arm.prewarm), forecasts=forecasts,
                         window_s=window_s, max_run_s=max_run_s)
        self.gpus = self.gpus[:n_gpus]
        self.pricer = SourcePricer(self, eprofile, self.arm, self.moves, ranks=self.ranks, slo=slo,
                                   arrivals=self.arrivals, arrived=self.arrived, freed=self.freed,
                                   group_of=self.group_of, moving=self.moving)
        self.executor = OfferExecutor(self, self.pricer, eprofile, self.moves, self._at, counts=self.counts,
                                      purchases=self.purchases, bought_starts=self.bought_starts, by_id=self.by_id,
                                      base_cost=self.base_cost, group_of=self.group_of, moving=self.moving)
        self.arbiter = EconomyArbiter(self, self.pricer, self.executor, self.arm,
                                      arrival_tokens=self.arrival_tokens, counts=self.counts)
        p = self.system.scaler
        for name, m in self.models.items():  # as the WarmServe repro: what the first window's forecast wants
            f = self.forecasts.get(name)
            want = max(1, math.ceil(f[0].avg / (p.scale_up_at * m.batch_size))) if f else 1
            for _ in range(want):
                if scale_up(self, name, 0.0, initial=True) is None:
                    break

    # --- hooks of the fleet simulator ----------------------------------------------------
    def _make_engine(self, iid: int, model: str, spec, cost) -> EconomyWorker:
        m = self.models[model]
        unbounded = self.arm.mode == "unbounded"
        if unbounded:
            spec = msgspec.structs.replace(spec, kv_blocks=UNBOUNDED_BLOCKS, watermark=0.0)
        w = EconomyWorker(iid, f"i{iid}", model, spec, cost, self.max_run_s)
        tp = m.parallel
        w.pool = Pool(self.profile.gpu.usable_bytes * tp, self.profile.weights_per_gpu(m) * tp,
                      self.eprofile.block_bytes(m), unbounded=unbounded)
        w.on_cold = self._cold_adapter
        w.all_resident = unbounded
        self.base_cost[iid] = cost
        self.engines.append(w)
        return w

    def _new_instance(self, *args, **kwargs) -> Instance:
        inst = super()._new_instance(*args, **kwargs)
        self.by_id[inst.id] = inst
        return inst

    def _adapter(self, rec) -> str | None:
        if rec.adapter is not None and rec.adapter not in self.ranks:
            raise ValueError(f"adapter {rec.adapter!r} has no rank in the trace header: cannot size it")
        return rec.adapter

    def _arrive(self, req: SimRequest, now: float) -> None:
        self.arrivals[req.model].append(now)
        self.arrived[req.model].append(now)
        kv_tokens = min(req.prompt + req.output, self.models[req.model].max_model_len)
        self.arrival_tokens[req.model].append((now, kv_tokens))
        if req.adapter:
            self.arrivals[req.adapter].append(now)
        super()._arrive(req, now)

    def _collect(self, inst: Instance, now: float) -> None:
        fin = inst.engine.finished
        if fin:
            block, bs = inst.engine.pool.block_bytes, inst.engine.bs  # type: ignore[attr-defined]
            self.freed[inst.id].append((now, sum(-(-(r.prompt + r.generated) // bs) for r in fin) * block))
        super()._collect(inst, now)

    def evict(self, replica: Replica) -> None:
        """A replica leaves: an instance that lent it KV gets that KV back."""
        super().evict(replica)
        for g in replica.gpus:
            inst = self.gpus[g].instance if g < len(self.gpus) else None
            if inst is not None and inst.kv_lent_blocks:
                inst.kv_lent_blocks = lent_blocks(self.gpus, inst)
                inst.engine.pool.lent_blocks = inst.kv_lent_blocks  # type: ignore[attr-defined]
                self._kick(inst, self.now)

    def _tick(self, t: float, more: bool) -> None:
        self.now = t
        super()._tick(t, more)
        for insts in self.instances.values():
            for inst in insts:
                inst.engine.pool.lent_blocks = inst.kv_lent_blocks  # type: ignore[attr-defined]

    def _event(self, kind: int, obj: object, gen: int, t: float) -> None:
        self.now = t
        if kind == ECON_TICK:
            self.arbiter.tick(t)
            if self._more(t):
                self._at(t + self.eprofile.spec.tick_s, ECON_TICK, None)
        elif kind == SAMPLE:
            self._sample(t)
            if self._more(t):
                self._at(t + self.sample_interval_s, SAMPLE, None)
        elif kind == MOVE:
            self.executor.move_event(obj[0], obj[1], t)  # type: ignore[index]
        elif kind == RESTORED:
            self.executor.restored(obj, t)  # type: ignore[arg-type]
        else:
            super()._event(kind, obj, gen, t)

    # --- helpers -------------------------------------------------------------------------
    def _more(self, t: float) -> bool:
        return t < self.trace.header.duration_s or self.done < len(self.trace.records)

    def _at(self, t: float, kind: int, payload: object) -> None:
        heappush(self.heap, (t, next(self.seq), kind, payload, 0))

    def _kick(self, inst: Instance, now: float) -> None:
        """Let an idle engine plan again (its memory or batch changed); release a drained stopped one."""
        w = inst.engine
        if inst.ready_at <= now and not w.busy and inst in self.instances[inst.model]:
            end = w.plan(now)
            if end is not None:
                heappush(self.heap, (end, next(self.seq), STEP, inst, w.gen))
            self._collect(inst, now)
        if inst.grace and inst.outstanding == 0 and inst in self.instances[inst.model]:
            self._release(inst, now)

    def _cold_adapter(self, w: EconomyWorker, name: str, req: SimRequest) -> float:
        """The one cold-adapter path: it becomes resident (LRU beyond the slots, never one in use), and
        either the admitting step waits for its load (inline) or, with CaraServe's path, the step runs on
        and this request's first token is late by the CPU-assisted extra."""
        rank = self.ranks[name]
        load = self.eprofile.adapter_load_s(rank)
        w.adapters[name] = None
        w.pool.adapters[name] = self.eprofile.adapter_bytes(rank)
        w.adapter_loads += 1
        if len(w.adapters) > self.eprofile.spec.adapter_slots:
            busy = w.running_adapters()
            for old in list(w.adapters):
                if len(w.adapters) <= self.eprofile.spec.adapter_slots:
                    break
                if old != name and old not in busy:
                    del w.adapters[old], w.pool.adapters[old]
                    self.counts["adapter_slot_evictions"] += 1
        if self.arm.cpu_assist:
            self.counts["cold_adapters_cpu"] += 1
            if req.first_token < 0:
                extra = self.eprofile.cpu_assist_extra_s(req.to_prefill, rank, w.cost.step_s(0, 0, req.to_prefill),
                                                         load)
                self.ttft_extra[req.order] = self.ttft_extra.get(req.order, 0.0) + extra
            return 0.0
        self.counts["cold_adapters_inline"] += 1
        return load

    def _sample(self, t: float) -> None:
        usable = self.profile.gpu.usable_bytes
        for g in self.gpus:
            inst = g.instance
            if inst is None:
                held = g.held_bytes()
                self.pool_samples.append(PoolSample(t, g.index, 0, held, 0, 0, usable - held))
                continue
            w, tp = inst.engine, len(inst.gpus)
            p: Pool = w.pool  # type: ignore[attr-defined]
            used = w.used * p.block_bytes // tp
            if p.unbounded:
                rest = usable - (p.weights + p.adapter_bytes) // tp
                self.pool_samples.append(PoolSample(t, g.index, p.weights // tp, 0, p.adapter_bytes // tp, used,
                                                    max(0, rest - used)))
                continue
            total = p.kv_blocks() * p.block_bytes // tp
            self.pool_samples.append(PoolSample(t, g.index, (p.weights - p.dropped) // tp,
                                                p.lent_blocks * p.block_bytes // tp, p.adapter_bytes // tp, used,
                                                total - used, p.dropped // tp))

    # --- the run -------------------------------------------------------------------------
    def run(self) -> EconomyResult:  # type: ignore[override]
        self.now = 0.0
        if self.arm.mode in ("single", "fixed", "arbiter", "fixed-needs"):
            self._at(0.0, ECON_TICK, None)
        self._at(0.0, SAMPLE, None)
        return super().run()  # type: ignore[return-value]

    def _result(self, reqs: list[SimRequest]) -> EconomyResult:  # type: ignore[override]
        names = list(self.models)
        idx = {m: k for k, m in enumerate(names)}
        ok = [r.status == "ok" and r.first_token >= 0 for r in reqs]
        extra = self.ttft_extra
        ttft = np.array([r.first_token - r.arrival + extra.get(r.order, 0.0) if good else np.nan
                         for r, good in zip(reqs, ok)])
        tpot = np.array([(r.finish - r.first_token) / (r.output - 1) if good and r.output > 1 else np.nan
                         for r, good in zip(reqs, ok)])
        cost = {n: self.profile.step_cost(m) for n, m in self.models.items()}
        unloaded = np.array([cost[r.model].step_s(0, 0, r.prompt) for r in reqs])
        # only the arm's own purchases: the shared autoscaler's starts are the base (every arm has them),
        # counted apart as `autoscaler_starts`, not added to the purchases (issue 32)
        purchases = list(self.purchases)
        purchases.sort(key=lambda p: p.t)
        counts = Counter(self.counts)
        counts["preemptions"] = sum(w.preemptions for w in self.engines)
        counts["adapter_loads"] = sum(w.adapter_loads for w in self.engines)
        for s in self.start_log:
            counts[f"starts_{s.source}"] += 1
        counts["autoscaler_starts"] = sum(1 for s in self.start_log if s.id not in self.bought_starts)
        counts["prewarm_hits"] = counts["starts_gpu"]
        counts["prewarms"], counts["proactive_prewarms"], counts["replica_evictions"] = \
            self.prewarms, self.proactive, self.evicted
        counts["failed_requests"] = sum(1 for r in reqs if r.status != "ok")
        return EconomyResult(self.arm.name, len(self.gpus), names, np.array([idx[r.model] for r in reqs], np.int64),
                             ttft, tpot, unloaded, purchases, self.pool_samples, dict(counts),
                             np.array([r.arrival for r in reqs]), np.array([r.epoch for r in reqs], np.int64))


def run_economy(trace: Trace, profile: EconomyProfile, arm: str, *, gpus: int | None = None, seed: int = 0,
                sample_interval_s: float = 5.0, forecasts=None, max_run_s: float = 0.5,
                slo: tuple[float, float] = (5.0, 1.0)) -> EconomyResult:
    """One arm on one trace. `forecasts`: EconomyForecasts (economy_forecasts) or {model: [LoadForecast]}
    per 300 s window; None: no forecasts (the prewarm planner then places nothing new). The simulator is
    deterministic: `seed` is recorded by the caller, nothing here draws."""
    del seed
    return EconomySim(profile, trace, arm, gpus=gpus, forecasts=forecasts, sample_interval_s=sample_interval_s,
                      max_run_s=max_run_s, slo=slo).run()


def economy_forecasts(profile: EconomyProfile, history: Trace, run: Trace, window_s: float) -> EconomyForecasts:
    """Per model, WarmServe's CSP forecast of each window of the run from the history (earlier periods of the
    same workload) and the run so far, of the load WarmServe's repro forecasts (requests in the system)."""
    from loadgen.repro.warmserve_setup import window_loads

    params = getattr(run.header.params, "period_s", history.header.duration_s or run.header.duration_s)
    csp = CspParams(windows_per_season=max(1, round(params / window_s)))
    out: dict[str, list[LoadForecast]] = {}
    for m in profile.fleet.models:
        series = []
        for tr in (history, run):
            recs = [r for r in tr.records if r.model == m.name]
            t = np.array([r.arrival_s for r in recs])
            el = np.array([profile.fleet.request_s(m, 0, min(r.output_tokens, m.max_model_len)) for r in recs])
            series.append(window_loads(t, el, tr.header.duration_s, window_s) if tr.header.duration_s > 0
                          else ([], []))
        (h_avg, h_peak), (avg, peak) = series
        out[m.name] = [forecast(h_avg + avg[:k], h_peak + peak[:k], len(h_avg) + k, csp) for k in range(len(avg))]
    return EconomyForecasts(out, window_s)


def _main() -> None:
    from loadgen.traces.mixed import generate_mixed
    from loadgen.traces.schema import MixedParams

    ap = argparse.ArgumentParser(description="one arm of the economy simulator on a mixed trace")
    ap.add_argument("--arm", default="arbiter", choices=ARMS)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="economy-h800")
    ap.add_argument("--batch", type=int, default=0, help="requests per instance (dispatcher and engine); 0: the profile's")
    args = ap.parse_args()
    profile = load_economy_profile(args.profile)
    if args.batch:
        profile = replace(profile, fleet=with_models(profile.fleet, batch_size=args.batch))
    dur = args.minutes * 60

    def trace(seed: int) -> Trace:
        return generate_mixed(MixedParams(seed=seed, duration_s=dur, rate=args.rate, period_s=dur,
                                          models=[m.name for m in profile.fleet.models],
                                          adapter_models=profile.adapter_models))
    run, history = trace(args.seed), trace(args.seed + 1000)  # an earlier "period" for the forecasts
    fc = economy_forecasts(profile, history, run, min(300.0, dur / 4))
    started = time.perf_counter()
    res = run_economy(run, profile, args.arm, gpus=args.gpus, forecasts=fc)
    wall = time.perf_counter() - started
    bought = Counter(p.source for p in res.purchases)
    print(f"arm {res.arm}: {len(res.ttft)} requests on {res.gpus} GPUs in {wall:.1f} s")
    print(f"P99 TTFT {res.p99_ttft():.3f} s  P50 {np.nanpercentile(res.ttft, 50):.3f} s  "
          f"SLO(5x, 1 s) {res.slo_attainment(5.0, 1.0):.3f}")
    print("purchases: " + ", ".join(f"{k} {v}" for k, v in sorted(bought.items())) +
          f"  (price {sum(p.price_request_s for p in res.purchases):.1f} request-s)")
    print("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(res.counts.items()) if v))


if __name__ == "__main__":
    _main()


__all__ = ["EconomyForecasts", "EconomyProfile", "EconomySim", "economy_forecasts", "load_economy_profile",
           "run_economy"]
