"""WarmServe's evict-aware placement of prewarm replicas (§5.2, Alg. 1), and the scale-up choice; pure.

For each replica, in priority order (every basic before every burst, then by score):
1. Candidates: idle and universal GPUs, and dedicated ones in their grace period (proactive
   prewarming; their `free_bytes` is the KV surplus above Eq. 1's target), each with room for
   S/D bytes -- free bytes plus what lower-priority replicas there would give back if evicted.
   GPUs that already hold a replica of the model, or serve it, are left out.
2. Groups: D candidates on one server that do not *partially* overlap any placed replica (the
   two GPU sets are disjoint, or one contains the other) and that fit after evicting, lowest
   priority first, replicas nested with the group that rank below the new one.
3. Choice: among the groups whose nested replicas all rank below the new one, the one whose nested
   replicas' scores sum least (the high-priority replicas stay isolated); if there is none,
   the least sum overall. Ties go to the lexicographically first group.
A replica with no valid group is skipped. Evicting a replica drops it from all its GPUs (a
partial prewarm cannot start an instance). `scale_up_target` picks, among a model's prewarmed
replicas, the one whose dedication evicts the least score (§5.2's last paragraph).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.policy.warmserve_lifecycle import WorkerRole
from shared.policy.warmserve_replicas import ModelDemand, PrewarmReplica, by_priority, prewarm_replicas

MAX_GROUPS_PER_SERVER = 20_000  # combinations tried per server and replica (C(16, 8) = 12870)


@dataclass(frozen=True)
class Gpu:
    worker: str
    server: str
    free_bytes: int  # free now for prewarming, not counting the bytes of replicas already placed on it
    role: WorkerRole = WorkerRole.IDLE
    grace: bool = False
    serving: str | None = None  # the model of its instance, when dedicated

    def __post_init__(self) -> None:
        if self.free_bytes < 0:
            raise ValueError(f"{self.worker}: free_bytes must be >= 0, got {self.free_bytes}")

    @property
    def candidate(self) -> bool:
        return self.role is not WorkerRole.DEDICATED or self.grace


@dataclass(frozen=True)
class PlacedReplica:
    replica: PrewarmReplica
    workers: frozenset[str]
    bytes_per_worker: int

    @property
    def model(self) -> str:
        return self.replica.model


@dataclass(frozen=True)
class PlacementPlan:
    placed: tuple[PlacedReplica, ...]  # the new replicas, in the order they were placed
    evicted: tuple[PlacedReplica, ...]  # replicas (existing, or placed earlier in this run) evicted for them
    skipped: tuple[PrewarmReplica, ...]  # no valid group


@dataclass(frozen=True)
class ScaleUp:
    replica: PlacedReplica  # the prewarmed replica whose GPUs the new instance takes
    evicted: tuple[PlacedReplica, ...]  # other replicas on those GPUs, dropped by the dedication


def partially_overlaps(a: frozenset[str], b: frozenset[str]) -> bool:
    return bool(a & b) and not (a <= b or b <= a)


def place(demands: Sequence[ModelDemand], gpus: Sequence[Gpu], existing: Iterable[PlacedReplica] = ()) -> PlacementPlan:
    by_name = {g.worker: g for g in gpus}
    if len(by_name) != len(gpus):
        raise ValueError("two GPUs share a worker id")
    models = {d.model: d for d in demands}
    if len(models) != len(demands):
        raise ValueError("two demands name the same model")
    live = list(existing)
    used = {w: 0 for w in by_name}
    for r in live:
        unknown = r.workers - by_name.keys()
        if unknown:
            raise ValueError(f"replica of {r.model!r} is on unknown worker(s) {sorted(unknown)}")
        for w in r.workers:
            used[w] += r.bytes_per_worker
    budget = {w: g.free_bytes + used[w] for w, g in by_name.items()}
    placed: list[PlacedReplica] = []
    evicted: list[PlacedReplica] = []
    skipped: list[PrewarmReplica] = []
    for replica in by_priority([r for d in demands for r in prewarm_replicas(d)]):
        d = models[replica.model]
        choice = _best_group(replica, d, by_name, live, used, budget)
        if choice is None:
            skipped.append(replica)
            continue
        group, victims = choice
        for v in victims:
            live.remove(v)
            evicted.append(v)
            for w in v.workers:
                used[w] -= v.bytes_per_worker
        new = PlacedReplica(replica, group, d.bytes_per_gpu)
        for w in group:
            used[w] += new.bytes_per_worker
        live.append(new)
        placed.append(new)
    return PlacementPlan(tuple(placed), tuple(evicted), tuple(skipped))


def _best_group(replica: PrewarmReplica, d: ModelDemand, gpus: dict[str, Gpu], live: list[PlacedReplica],
                used: dict[str, int], budget: dict[str, int]) -> tuple[frozenset[str], list[PlacedReplica]] | None:
    need = d.bytes_per_gpu
    own = set().union(*(r.workers for r in live if r.model == d.model))
    lower = [r for r in live if r.replica.priority < replica.priority]
    servers: dict[str, list[str]] = {}
    for w, g in sorted(gpus.items()):
        if not g.candidate or g.serving == d.model or w in own:
            continue
        reclaimable = sum(r.bytes_per_worker for r in lower if w in r.workers)
        if budget[w] - used[w] + reclaimable >= need:
            servers.setdefault(g.server, []).append(w)
    best: tuple[tuple[bool, float, tuple[str, ...]], frozenset[str], list[PlacedReplica]] | None = None
    for _server, workers in sorted(servers.items()):
        for combo in itertools.islice(itertools.combinations(workers, d.parallel), MAX_GROUPS_PER_SERVER):
            group = frozenset(combo)
            nested = [r for r in live if r.workers & group]
            if any(partially_overlaps(group, r.workers) for r in nested):
                continue
            victims = _evictions(group, need, nested, replica, used, budget)
            if victims is None:
                continue
            outranked = any(r.replica.priority >= replica.priority for r in nested)
            key = (outranked, sum(r.replica.score for r in nested), combo)
            if best is None or key < best[0]:
                best = (key, group, victims)
    return None if best is None else (best[1], best[2])


def _evictions(group: frozenset[str], need: int, nested: list[PlacedReplica], replica: PrewarmReplica,
               used: dict[str, int], budget: dict[str, int]) -> list[PlacedReplica] | None:
    """The lowest-priority nested replicas to evict so that every GPU of the group has `need` free."""
    free = {w: budget[w] - used[w] for w in group}
    victims: list[PlacedReplica] = []
    for r in sorted((r for r in nested if r.replica.priority < replica.priority),
                    key=lambda r: (r.replica.priority, r.model, r.replica.rank)):
        if all(f >= need for f in free.values()):
            break
        victims.append(r)
        for w in r.workers & group:
            free[w] += r.bytes_per_worker
    return victims if all(f >= need for f in free.values()) else None


def scale_up_target(model: str, replicas: Iterable[PlacedReplica]) -> ScaleUp | None:
    """The model's prewarmed replica whose GPUs, once dedicated, evict the least score; None if none."""
    live = list(replicas)
    best: tuple[tuple[float, tuple[str, ...]], ScaleUp] | None = None
    for r in live:
        if r.model != model:
            continue
        others = tuple(o for o in live if o is not r and o.workers & r.workers)
        key = (sum(o.replica.score for o in others), tuple(sorted(r.workers)))
        if best is None or key < best[0]:
            best = (key, ScaleUp(r, others))
    return None if best is None else best[1]


__all__ = ["Gpu", "PlacedReplica", "PlacementPlan", "ScaleUp", "partially_overlaps", "place", "scale_up_target"]
