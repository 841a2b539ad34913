"""Scale-up in the fleet simulator: where a model's next instance comes from, cheapest first.

1. ungrace: a draining instance of the model takes traffic again (its proactive prewarms go);
2. hit: free GPUs holding a complete replica of it; `scale_up_target` (WarmServe §5.2) picks
   the one whose dedication evicts the least prewarming score; starts in hit_start_s (plus
   engine_init_s for a system without an engine pool);
3. partial: free GPUs still loading a replica of it: ready when both the load and the
   start-up are done (counted as a miss);
4. cold: D free GPUs on one server, evicting the least score (then the fewest replicas):
   hit_start_s + T_c (the checkpoint from host memory, or from disk first: FleetProfile.load_s).
Returns False when there is no room (the requests wait; the next tick retries).
"""
from __future__ import annotations

import itertools

from loadgen.sim.fleet_state import FleetControl, Replica
from shared.policy.warmserve import PlacedReplica, PrewarmReplica, scale_up_target


def view(r: Replica) -> PlacedReplica:
    """The policy's view of a replica; one never scored (a cached stopped instance) scores 0."""
    if r.placed is not None and r.placed.workers == frozenset(map(str, r.gpus)):
        return r.placed
    return PlacedReplica(PrewarmReplica(r.model, "burst", 0, 0.0), frozenset(map(str, r.gpus)), r.bytes_per_gpu)


def _score(r: Replica) -> float:
    return view(r).replica.score


def scale_up(sim: FleetControl, model: str, now: float, initial: bool = False) -> bool:
    m = sim.models[model]
    hit_s = sim.profile.hit_start_s(sim.system.engine_pool)
    for inst in sim.instances[model]:
        if inst.grace:
            sim.ungrace(inst)
            return True
    free = {g.index for g in sim.gpus if g.instance is None}
    mine = [r for r in sim.replicas if r.model == model and set(r.gpus) <= free]
    loaded = [r for r in mine if r.loaded(now)]
    if loaded and not initial:
        pairs = [(view(r), r) for r in sim.replicas if r in loaded or r.model != model]
        target = scale_up_target(model, [v for v, _ in pairs])
        assert target is not None  # `loaded` is not empty
        chosen = next(r for v, r in pairs if v is target.replica)
        sim.dedicate(model, chosen.gpus, now + hit_s, "hit")
        return True
    loading = [r for r in mine if not r.loaded(now)]
    if loading and not initial:
        r = min(loading, key=lambda r: r.ready_at)
        sim.dedicate(model, r.gpus, max(now + hit_s, r.ready_at), "partial")
        return True
    group = _cold_group(sim, m.parallel, free)
    if group is None:
        return False
    ready = 0.0 if initial else now + sim.profile.cold_start_s(m, sim.system.engine_pool)
    sim.dedicate(model, group, ready, "initial" if initial else "cold")
    return True


def _cold_group(sim: FleetControl, d: int, free: set[int]) -> tuple[int, ...] | None:
    best: tuple[tuple[float, int, tuple[int, ...]], tuple[int, ...]] | None = None
    by_server: dict[int, list[int]] = {}
    for g in sorted(free):
        by_server.setdefault(sim.gpus[g].server, []).append(g)
    for gpus in by_server.values():
        for combo in itertools.combinations(gpus, d):
            hit = {r for g in combo for r in sim.gpus[g].replicas}
            key = (sum(_score(r) for r in hit), len(hit), combo)
            if best is None or key < best[0]:
                best = (key, combo)
    return None if best is None else best[1]
