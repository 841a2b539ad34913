"""Scale-up in the fleet simulator: where a model's next instance comes from, cheapest first.

1. gpu (a prewarm hit): free GPUs holding a complete replica of it; `scale_up_target` (WarmServe
   §5.2) picks the one whose dedication evicts the least prewarming score; it serves after
   the model's hit_start_s (plus engine_init_s for a system without an engine pool);
2. partial: free GPUs still loading a replica of it: it serves when both the load and the start-up
   are done (a miss);
3. host / storage (cold): D free GPUs on one server, evicting the least score (then the fewest
   replicas): hit_start_s + T_c, the checkpoint over the host link from host memory ("host"), or
   from storage first where checkpoints are not in host memory ("storage"): FleetProfile.load_s.
Every system pays the same costs for the same source. Returns the new instance, or None when no
GPUs are free (the requests wait; the autoscaler's next period retries). Stopped instances are
never taken back (the public code removes a stopping engine from scheduling for good).
"""
from __future__ import annotations

import itertools

from loadgen.sim.fleet_state import FleetControl, Instance, Replica
from shared.policy.warmserve import PlacedReplica, PrewarmReplica, scale_up_target


def view(r: Replica) -> PlacedReplica:
    """The policy's view of a replica; one never scored (weights a stopped instance left) scores 0."""
    if r.placed is not None and r.placed.workers == frozenset(map(str, r.gpus)):
        return r.placed
    return PlacedReplica(PrewarmReplica(r.model, "burst", 0, 0.0), frozenset(map(str, r.gpus)), r.bytes_per_gpu)


def _score(r: Replica) -> float:
    return view(r).replica.score


def scale_up(sim: FleetControl, model: str, now: float, initial: bool = False) -> Instance | None:
    m = sim.models[model]
    hit_s = sim.profile.hit_start_s(sim.system.engine_pool, m)
    free = {g.index for g in sim.gpus if g.instance is None}
    mine = [r for r in sim.replicas if r.model == model and set(r.gpus) <= free]
    loaded = [r for r in mine if r.loaded(now)]
    if loaded and not initial:
        pairs = [(view(r), r) for r in sim.replicas if r in loaded or r.model != model]
        target = scale_up_target(model, [v for v, _ in pairs])
        assert target is not None  # `loaded` is not empty
        chosen = next(r for v, r in pairs if v is target.replica)
        return sim.dedicate(model, chosen.gpus, now, now + hit_s, chosen.ready_at, "gpu", chosen.origin)
    loading = [r for r in mine if not r.loaded(now)]
    if loading and not initial:
        r = min(loading, key=lambda r: r.ready_at)
        return sim.dedicate(model, r.gpus, now, max(now + hit_s, r.ready_at), r.ready_at, "partial", r.origin)
    group = _cold_group(sim, m.parallel, free)
    if group is None:
        return None
    if initial:
        return sim.dedicate(model, group, now, now, now, "initial")
    load = sim.profile.load_s(m)
    source = "host" if sim.profile.startup.checkpoints_in_host_memory else "storage"
    return sim.dedicate(model, group, now, now + hit_s + load, now + load, source)


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
