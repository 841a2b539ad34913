"""WarmServe's prewarm planner inside the fleet simulator: the pure policy, fed from sim state.

Each round (a new forecast window, or a GPU / grace-period change, at most once per tick):
1. per model, a `ModelDemand` from the window's CSP forecast (concurrent requests: L_A, L_P),
   its non-draining instances (K), its batch size and T_c (the whole weights' load time);
2. the replicas already there (placed, proactive, or left by a stopped instance) are re-scored with
   the model's current top ranks (Eqs. 7-8); extras score 0 (first to go). The demand then counts
   them as instances, so Alg. 1 only adds what is missing (a simplification: a new replica's rank
   restarts at 0);
3. `place` (Alg. 1) over the GPUs: idle / universal ones with their free memory, and, with
   proactive prewarming, grace-period ones with their KV surplus above Eq. 1's reservation
   target (`prewarm_room`) - the KV they lend shrinks the draining engine's block budget;
4. evictions are applied and each placed replica loads over its GPUs' host links.
"""
from __future__ import annotations

import math
from dataclasses import replace

from loadgen.sim.fleet_profile import BLOCK_TOKENS
from loadgen.sim.fleet_state import FleetControl, GpuState, Replica
from shared.policy.warmserve import (
    Gpu, ModelDemand, PlacedReplica, PrewarmReplica, WorkerRole, by_priority, place, prewarm_replicas, prewarm_room,
)
from shared.policy.warmserve_predictor import LoadForecast


class Prewarmer:
    def __init__(self, sim: FleetControl) -> None:
        self.sim = sim
        self.proactive = sim.system.prewarm == "proactive"

    def _forecast(self, model: str) -> LoadForecast:
        series = self.sim.forecasts.get(model)
        return series[min(self.sim.window, len(series) - 1)] if series else LoadForecast(0.0, 0.0)

    def _gpu(self, g: GpuState, now: float) -> Gpu:
        inst = g.instance
        if inst is None:
            role = WorkerRole.UNIVERSAL if g.replicas else WorkerRole.IDLE
            return Gpu(str(g.index), str(g.server), max(0, self.sim.profile.gpu.usable_bytes - g.held_bytes()), role)
        if not (inst.grace and self.proactive):
            return Gpu(str(g.index), str(g.server), 0, WorkerRole.DEDICATED, serving=inst.model)
        eng = inst.engine
        block = eng.spec.kv_bytes_per_token * BLOCK_TOKENS
        room = prewarm_room(inst.kv_blocks * block, eng.spec.max_batch, inst.outstanding, eng.used * block,
                            eng.total * block)
        return Gpu(str(g.index), str(g.server), int(room / len(inst.gpus)), WorkerRole.DEDICATED, grace=True,
                   serving=inst.model)

    def plan(self, now: float) -> None:
        sim = self.sim
        demands: list[ModelDemand] = []
        existing: list[PlacedReplica] = []
        ours: dict[int, Replica] = {}
        for name, m in sim.models.items():
            f = self._forecast(name)
            active = sum(1 for i in sim.instances[name] if not i.grace)
            base = ModelDemand(name, m.weights_bytes, m.parallel, m.batch_size, active, f.avg, f.peak,
                               sim.profile.load_s(m))
            wanted = by_priority(prewarm_replicas(base))
            mine = sorted((r for r in sim.replicas if r.model == name), key=lambda r: (not r.loaded(now), r.ready_at))
            for k, r in enumerate(mine):
                pr = wanted[k] if k < len(wanted) else PrewarmReplica(name, "burst", k, 0.0)
                r.placed = PlacedReplica(pr, frozenset(map(str, r.gpus)), r.bytes_per_gpu)
                existing.append(r.placed)
                ours[id(r.placed)] = r
            demands.append(replace(base, active=active + len(mine)))
        result = place(demands, [self._gpu(g, now) for g in sim.gpus], existing)
        gone = {id(v) for v in result.evicted}
        for v in result.evicted:
            if id(v) in ours:
                sim.evict(ours[id(v)])
        for v in result.placed:
            if id(v) not in gone:
                self._load(v, now)
        sim.dirty = False  # its own placements and evictions need no new round

    def _load(self, v: PlacedReplica, now: float) -> None:
        sim = self.sim
        gpus = tuple(sorted(int(w) for w in v.workers))
        graced = {sim.gpus[g].instance for g in gpus} - {None}
        for inst in graced:  # lend the KV surplus: the draining engine keeps Eq. 1's target
            block = inst.engine.spec.kv_bytes_per_token * BLOCK_TOKENS
            held = max(sim.gpus[g].held_bytes() + (v.bytes_per_worker if g in gpus else 0) for g in inst.gpus)
            lent = math.ceil(held * len(inst.gpus) / block)
            if inst.kv_blocks - lent < inst.engine.used:
                return  # the KV grew since the round began: skip this replica
        for inst in graced:
            block = inst.engine.spec.kv_bytes_per_token * BLOCK_TOKENS
            held = max(sim.gpus[g].held_bytes() + (v.bytes_per_worker if g in gpus else 0) for g in inst.gpus)
            inst.kv_lent_blocks = math.ceil(held * len(inst.gpus) / block)
            inst.engine.total = inst.kv_blocks - inst.kv_lent_blocks
        start = max(sim.gpus[g].link_free(now) for g in gpus)
        ready = start + sim.profile.load_s(sim.models[v.model], v.bytes_per_worker)
        sim.add_replica(Replica(v.model, gpus, v.bytes_per_worker, ready, origin="proactive" if graced else "placed",
                                proactive=bool(graced), placed=v))
        sim.prewarms += 1
        sim.proactive += bool(graced)
