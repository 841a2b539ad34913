"""The dispatcher's live view of workers and their model instances (pure; time passed in).

Fed by `WorkerStats` (every 250 ms: instances, their registered LoRA adapters, batch, queue,
KV), `WorkerHeartbeat`s and the registry's worker records. The view adds what this dispatcher
assigned that the stats do not list yet and subtracts what finished that they still list, so a
burst of submits does not pile onto the instance that looked idle 250 ms ago. "Listed" is by
request id (`InstanceStats.requests`): a worker's stats carry its engine's last snapshot, which
is as old as the engine's current step — seconds on a busy CPU — so a stats message does not
mean the worker has seen what was sent before it.

A worker is lost when it falls silent for `dead_after` (no heartbeat and no stats), when the
registry marks it dead, or when it restarts (a new incarnation: the old process's requests
are gone). Lost workers' instances take no assignments until the worker is heard from again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.events import InstanceStats, WorkerHeartbeat, WorkerRecord, WorkerState, WorkerStats
from shared.events.worker import MAX_REQUEST_LOADS
from shared.policy.routing import InstanceView
from shared.policy.routing_groups import GroupBatch, collapse_groups, summed_batch


@dataclass(slots=True)
class InstanceLoad:
    """What this dispatcher knows about an instance beyond its last stats."""

    own: dict[str, int] = field(default_factory=dict)  # our requests assigned here and not finished -> LoRA rank
    since: dict[str, int] = field(default_factory=dict)  # ours the stats do not list yet -> prompt tokens
    finished: dict[str, int] = field(default_factory=dict)  # ours that finished but the stats still list -> rank


@dataclass(slots=True)
class WorkerView:
    worker_id: str
    state: WorkerState = WorkerState.STARTING
    incarnation: str | None = None
    last_heard: float | None = None  # None: never heard from (only named by the registry)
    stats_at: float | None = None
    instances: dict[str, InstanceStats] = field(default_factory=dict)
    resident_adapters: frozenset[str] = frozenset()
    adapters: dict[str, frozenset[str]] = field(default_factory=dict)  # instance -> registered adapters
    lost: bool = False


@dataclass(frozen=True, slots=True)
class WorkerLost:
    worker_id: str
    incarnation: str | None  # the incarnation that was lost (None: any)
    why: str


class InstanceTable:
    def __init__(self, *, dead_after: float, block_size: int, max_batch: int,
                 group_batch: GroupBatch = summed_batch) -> None:
        self.dead_after = dead_after
        self.block_size = block_size
        self.max_batch = max_batch
        self.group_batch = group_batch  # a KunServe buddy group's batch limit by stage count (§4.3)
        self.workers: dict[str, WorkerView] = {}
        self.loads: dict[str, InstanceLoad] = {}
        self._instance_worker: dict[str, str] = {}
        self.restoring_groups: set[str] = set()  # buddy groups being restored (registry): routed nothing new

    def _worker(self, worker_id: str) -> WorkerView:
        view = self.workers.get(worker_id)
        if view is None:
            view = self.workers[worker_id] = WorkerView(worker_id)
        return view

    # --- inputs ---------------------------------------------------------------------------
    def stats(self, msg: WorkerStats, now: float) -> list[str]:
        """Take a worker's stats; returns the models it serves (their queues may move now)."""
        w = self._worker(msg.worker_id)
        w.last_heard, w.stats_at, w.state, w.lost = now, now, msg.state, False
        w.instances = {inst.instance_id: inst for inst in msg.instances}
        w.resident_adapters = frozenset(msg.resident_adapters)
        w.adapters = {inst.instance_id: frozenset(inst.adapters) for inst in msg.instances}
        for iid, inst in w.instances.items():
            self._instance_worker[iid] = msg.worker_id
            load = self.loads.get(iid)
            if load is not None:
                listed = {r.request_id for r in inst.requests}
                # the list is whole (not capped, not left out while requests run): else take the stats as current
                whole = len(listed) < MAX_REQUEST_LOADS and (bool(listed) or not inst.running + inst.waiting)
                load.since = {rid: n for rid, n in load.since.items() if whole and rid not in listed}
                load.finished = {rid: r for rid, r in load.finished.items() if whole and rid in listed}
                if not load.own and not load.finished:
                    del self.loads[iid]
        return sorted({inst.model for inst in msg.instances})

    def heartbeat(self, msg: WorkerHeartbeat, now: float) -> WorkerLost | None:
        w = self._worker(msg.worker_id)
        restarted = w.incarnation is not None and msg.incarnation != w.incarnation
        lost = WorkerLost(msg.worker_id, w.incarnation, "restarted") if restarted else None
        w.incarnation, w.last_heard, w.state, w.lost = msg.incarnation, now, msg.state, False
        if restarted:
            w.instances = {}  # the new process reports its own instances
        return lost

    def record(self, rec: WorkerRecord, now: float) -> WorkerLost | None:
        """A registry worker record (catalog change): dead or draining.

        Restarts are detected from heartbeats only (they come straight from the process, in
        order); a record may describe an older incarnation than the one already heard from.
        """
        w = self._worker(rec.worker_id)
        if w.incarnation and rec.incarnation and rec.incarnation != w.incarnation:
            return None  # about another incarnation than the one we hear
        if w.incarnation is None and rec.incarnation:
            w.incarnation = rec.incarnation
        if rec.state is WorkerState.DEAD:
            return None if w.lost else self.lose(rec.worker_id, "the registry marked it dead")
        if rec.state is WorkerState.DRAINING:
            w.state = WorkerState.DRAINING
        return None

    def expire(self, now: float) -> list[WorkerLost]:
        """Workers silent for `dead_after` (no heartbeat, no stats) are lost."""
        return [self.lose(w.worker_id, f"silent for {now - w.last_heard:.1f}s")
                for w in list(self.workers.values())
                if not w.lost and w.last_heard is not None and now - w.last_heard >= self.dead_after]

    def lose(self, worker_id: str, why: str) -> WorkerLost:
        w = self._worker(worker_id)
        w.lost, w.instances = True, {}
        return WorkerLost(worker_id, w.incarnation, why)

    def is_lost(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.lost

    def draining(self, worker_id: str) -> None:
        self._worker(worker_id).state = WorkerState.DRAINING

    # --- our own assignments --------------------------------------------------------------
    def assigned(self, instance_id: str, request_id: str, prefill_tokens: int, rank: int = 0) -> None:
        """`rank`: the request's LoRA rank (0: none), shown as waiting until the worker's next stats."""
        load = self.loads.setdefault(instance_id, InstanceLoad())
        load.own[request_id] = rank
        load.since[request_id] = prefill_tokens

    def released(self, instance_id: str | None, request_id: str) -> None:
        load = self.loads.get(instance_id) if instance_id else None
        if load is None or request_id not in load.own:
            return
        rank = load.own.pop(request_id)
        if load.since.pop(request_id, None) is None:  # the stats list it: count it out until they do not
            load.finished[request_id] = rank
        if not load.own and not load.finished:  # (since is a subset of own)
            del self.loads[instance_id]  # type: ignore[arg-type]

    # --- reading --------------------------------------------------------------------------
    def routable(self, w: WorkerView, now: float) -> bool:
        return (not w.lost and w.state is WorkerState.READY and w.last_heard is not None and w.stats_at is not None
                and now - w.last_heard < self.dead_after and now - w.stats_at < self.dead_after)

    def views(self, model: str, now: float) -> list[InstanceView]:
        """Instances of `model` on routable workers, with this dispatcher's recent assignments added; a
        buddy group's members as one pooled instance, its entry (shared/policy/routing_groups.py)."""
        out: list[InstanceView] = []
        restoring: list[InstanceView] = []
        for w in self.workers.values():
            if not self.routable(w, now):
                continue
            for inst in w.instances.values():
                if inst.model == model and inst.accepting:  # not one being evicted (EvictModel)
                    (restoring if inst.group_id in self.restoring_groups else out).append(self._view(w, inst))
        units = collapse_groups(out, self.group_batch)
        if not units and restoring:  # a group being restored (KunServe) takes nothing new, unless it is all
            units = collapse_groups(out + restoring, self.group_batch)  # there is: never a 503 wedge
        return units

    def _view(self, w: WorkerView, inst: InstanceStats) -> InstanceView:
        load = self.loads.get(inst.instance_id) or InstanceLoad()
        estimate = inst.running + inst.waiting + len(load.since) - len(load.finished)
        total = max(len(load.own), estimate, 0)
        running = min(inst.running, total)
        running_ranks, waiting_ranks = _ranks(inst, load)
        # A worker's block is one layer's KV; the router's is a block of tokens over every layer
        # held, so that KV tokens and queued prompt tokens add up in one unit (counting per-layer
        # blocks made a worker with 30 layers of KV look 30x busier than one with a queue).
        layers = max(1, inst.layers.end - inst.layers.start)
        return InstanceView(
            instance_id=inst.instance_id, worker_id=w.worker_id, model=inst.model, live=True,
            kv_blocks_used=-(-inst.kv_blocks_used // layers), kv_blocks_total=inst.kv_blocks_total // layers,
            block_size=self.block_size,
            queued_prompt_tokens=inst.queued_prompt_tokens + sum(load.since.values()), running_requests=running,
            waiting_requests=total - running, resident_adapters=w.resident_adapters,
            adapters=w.adapters.get(inst.instance_id, frozenset()), max_batch=self.max_batch,
            running_ranks=running_ranks, waiting_ranks=waiting_ranks,
            adapter_room_bytes=inst.adapter_room_bytes, kv_block_bytes=inst.kv_block_bytes * layers,
            group_id=inst.group_id, layers=(inst.layers.start, inst.layers.end),
        )

    def tokens_per_s(self, model: str, now: float) -> float:
        """Tokens per second `model`'s instances on routable workers generate (their latest stats)."""
        return sum(inst.tokens_per_s for w in self.workers.values() if self.routable(w, now)
                   for inst in w.instances.values() if inst.model == model)

    def worker_of(self, instance_id: str) -> str | None:
        return self._instance_worker.get(instance_id)

    def instance_on(self, worker_id: str, model: str) -> str | None:
        w = self.workers.get(worker_id)
        if w is None:
            return None
        return next((i.instance_id for i in w.instances.values() if i.model == model), None)

    def incarnation(self, worker_id: str) -> str | None:
        w = self.workers.get(worker_id)
        return None if w is None else w.incarnation

    def served_models(self, now: float) -> set[str]:
        return {i.model for w in self.workers.values() if self.routable(w, now) for i in w.instances.values()}


def _ranks(inst: InstanceStats, load: InstanceLoad) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stats' (running, waiting) ranks, less ours that finished since, plus ours assigned since
    (waiting: not yet in the batch as far as we know), so rank-aware routing sees a burst's ranks."""
    running, waiting = list(inst.running_ranks), list(inst.waiting_ranks)
    for rank in load.finished.values():
        for ranks in (running, waiting):
            if rank in ranks:
                ranks.remove(rank)
                break
    waiting += [load.own[rid] for rid in load.since]
    return tuple(running), tuple(waiting)
