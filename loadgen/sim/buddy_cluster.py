"""A simulated cluster of one model's replicas whose instances can merge into pipelined buddy
groups and split back (KunServe §4), with the §5 baselines: Llumnix replication (queue, and
preempt-recompute when KV is full), Llumnix with live migration, and static pipeline groups.

Engines are SimWorkers (continuous batching, chunked prefill, exact KV blocks): an unsplit
instance, or a group built by loadgen/sim/pipeline.py. Arrivals go to the engine with the most
free KV (Llumnix's load balancing). Every `tick_s` a controller looks at the instances:
- kunserve: KunServe's monitor (shared/policy/kunserve_monitor.py) decides drop / restore, and the
  drop plan is `shared.policy.kunserve.plan_drop` (throughput- or memory-greedy); the plan's
  deficit counts the queued prompts of memory-blocked instances only (a compute backlog is not a
  memory shortage). Each member drops at its own step boundary: the first to get there forms
  the group with its share of the memory, the others join at theirs (nobody idles waiting for a
  partner's long prefill). The victims' KV is exchanged over the link while they keep decoding
  with remote attention. While dropped, requests a group cannot batch (§4.3's batch limit)
  overflow back to the dispatcher, which re-routes them to engines with room. A restore reloads
  the dropped layers over PCIe and migrates the KV back over the link, then splits the group
  (cancelled if the burst returns meanwhile).
- migration: Llumnix's live migration with Llumnix's costs (loadgen/sim/llumnix_migration.py).
Regroups and migrations apply between steps (`at_boundary`): nothing completes a step early.
Every `sample_s` the cluster's KV occupancy, demand, waiting split and preemptions are sampled.
Pure of wall clock: time is the simulation's.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from heapq import heappop, heappush

from loadgen.sim.pipeline import (
    PipelineCost, group_cost, overflow, put_all, put_decoding, set_cost, settle, take_all,
)
from loadgen.sim.profile import CostProfile
from loadgen.sim.llumnix_migration import LlumnixMigration
from loadgen.sim.request import SimRequest
from loadgen.sim.timeline import ClusterSample, sample_workers
from loadgen.sim.worker import SimWorker
from loadgen.traces.schema import Trace
from shared.policy import kunserve_monitor as mon
from shared.policy.kunserve import plan_drop
from shared.policy.kunserve_groups import group_max_batch
from shared.policy.kunserve_load import InstanceLoad
from shared.policy.kunserve_profile import PipelineProfile

SYSTEMS = ("replication", "migration", "pipeline", "kunserve")


@dataclass
class ClusterConfig:
    system: str
    instances: int = 8
    strategy: str = "throughput_greedy"  # kunserve's drop plan
    static_stages: int = 2  # pipeline baseline: the group size KunServe finds under one throttling (§5.1)
    tick_s: float = 0.1
    monitor: mon.MonitorConfig = field(default_factory=mon.MonitorConfig)
    # the links come from the profile's [movement] section (shared/policy/movement.py): the one cost model


@dataclass
class Engine:
    worker: SimWorker
    members: list[int]  # instance indices, in stage order
    exchanging_until: float = 0.0
    restoring: bool = False
    draining: bool = False  # waiting for its step in progress to end before a merge: starts no new step
    joined: list[int] | None = None  # a forming group: the members that dropped so far (None: all)


class BuddyCluster:
    def __init__(self, trace: Trace, profile: CostProfile, pipeline: PipelineProfile, pipe: PipelineCost,
                 cfg: ClusterConfig, num_layers: int, layer_bytes: int, sample_s: float = 0.25) -> None:
        if cfg.system not in SYSTEMS:
            raise ValueError(f"unknown system {cfg.system!r}; known: {', '.join(SYSTEMS)}")
        self.trace, self.profile, self.pipeline, self.pipe, self.cfg = trace, profile, pipeline, pipe, cfg
        self.num_layers, self.layer_bytes = num_layers, layer_bytes
        self.moves = profile.movement_costs()
        self.link = self.moves.kv  # activations and KV between members
        self.block_bytes = profile.worker.kv_bytes_per_token * profile.worker.block_size
        self.model = trace.records[0].model if trace.records else "model"
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.engines: dict[int, Engine] = {}
        self.eid = itertools.count()
        self.state = mon.MonitorState()
        self.prev_used: dict[int, int] = {}
        self.drops = self.restores = 0
        self.overflowed = 0  # requests a group sent back to the dispatcher (§4.3)
        self.max_stages = pipeline.max_stages
        self.grouped_time = 0.0
        self.hooks: dict[int, list[Callable[[float], None]]] = {}  # engine id -> run at its next step boundary
        self.migration = LlumnixMigration(self)
        self.preemptions_gone = 0  # preemptions counted by engines since replaced (merges, splits)
        self.samples: list[ClusterSample] = []
        self.sample_s = sample_s
        if cfg.system == "pipeline":
            k = cfg.static_stages
            for g in range(cfg.instances // k):
                self._new_engine(list(range(g * k, (g + 1) * k)), 0.0)
        else:
            for i in range(cfg.instances):
                self._new_engine([i], 0.0)

    # --- engines ---------------------------------------------------------------------------
    def _share_blocks(self, k: int) -> int:
        """KV blocks one member brings to a k-member group: its own KV and the layers it drops."""
        spec = self.profile.worker
        return spec.kv_blocks + (k - 1) * self.num_layers * self.layer_bytes // k // self.block_bytes

    def _new_engine(self, members: list[int], now: float, exchange_s: float = 0.0) -> Engine:
        k, spec = len(members), self.profile.worker
        freed = (k - 1) * self.num_layers * self.layer_bytes
        batch = spec.max_batch if k == 1 else group_max_batch(k, spec.max_batch, self.pipeline)
        gspec = msgspec.structs.replace(spec, kv_blocks=k * spec.kv_blocks + freed // self.block_bytes, max_batch=batch,
                        max_batched_tokens=max(k * spec.max_batched_tokens, batch))  # a budget per micro-batch
        eid = next(self.eid)
        cost = group_cost(self.profile.step, k, self.link, self.pipe, exchanging=exchange_s > 0)
        w = SimWorker(eid, f"e{eid}", self.model, gspec, cost, 0.5)
        eng = Engine(w, members, exchanging_until=now + exchange_s)
        self.engines[eid] = eng
        if exchange_s > 0:
            self._at(now + exchange_s, 2, ("exchanged", eid))
        return eng

    def _at(self, t: float, kind: int, payload: object) -> None:
        heappush(self.events, (t, next(self.seq), kind, payload))

    def at_boundary(self, eng: Engine, now: float, fn: Callable[[float], None]) -> None:
        """Run `fn(t)` once `eng` is between two steps: now if idle, else when its step in progress
        ends (a decode run is cut after that step). Nothing is completed early or thrown away: a
        regroup or a migration waits for the engine, as the real ones apply between iterations."""
        w = eng.worker
        if not w.busy:
            fn(now)
            return
        if w.run_k > 1:
            end = w._truncate(now)
            if end is not None:
                self._at(end, 0, (w.index, w.gen))
        self.hooks.setdefault(w.index, []).append(fn)

    def _kick(self, eng: Engine, now: float) -> None:
        if eng.draining or eng.worker.index not in self.engines:
            return
        end = eng.worker.plan(now) if not eng.worker.busy else None
        if end is not None:
            self._at(end, 0, (eng.worker.index, eng.worker.gen))
        eng.worker.finished.clear()

    def _merge(self, member_ids: list[int], now: float) -> None:
        """Form a group: each member drops its layers at its own step boundary. The first one there
        creates the group with its share of the KV; the others bring theirs when they get there."""
        old = [e for e in list(self.engines.values()) if e.members[0] in member_ids and len(e.members) == 1]
        if len(old) != len(member_ids) or any(e.draining for e in old):
            return  # a member is in another group or already forming one: the plan is stale
        for e in old:
            e.draining = True
        k, members = len(member_ids), sorted(member_ids)
        forming: dict[str, Engine] = {}

        def join(e: Engine) -> Callable[[float], None]:
            def fn(t: float) -> None:
                settle(e.worker, t)
                e.worker.finished.clear()
                moved = take_all(e.worker)
                self._retire(e)
                blocks = sum(-(-c // e.worker.bs) for _, c, _ in moved.decoding)
                exchange = self.moves.kv.transfer_s(int(blocks * self.block_bytes * (k - 1) / k)) if blocks else 0.0
                group = forming.get("g")
                if group is None:
                    group = forming["g"] = self._new_engine(members, t)
                    group.joined, group.worker.total = [], 0
                    self.drops += 1
                self.at_boundary(group, t, lambda t2: self._land(group, e.members[0], moved, exchange, t2))
            return fn

        for e in old:
            self.at_boundary(e, now, join(e))

    def _land(self, group: Engine, member: int, moved, exchange_s: float, now: float) -> None:
        """A member's requests and memory join its (settled) group; its victims' KV starts moving."""
        if group.worker.index not in self.engines:
            return
        settle(group.worker, now)
        group.worker.finished.clear()
        assert group.joined is not None
        group.joined.append(member)
        k = len(group.members)
        group.worker.total = (group.worker.spec.kv_blocks if len(group.joined) == k
                              else group.worker.total + self._share_blocks(k))
        if len(group.joined) == k:
            group.joined = None
        put_all(group.worker, moved)
        if exchange_s > 0:
            if group.exchanging_until <= now:
                set_cost(group.worker, group_cost(self.profile.step, k, self.link, self.pipe, exchanging=True))
            group.exchanging_until = max(group.exchanging_until, now + exchange_s)
            self._at(group.exchanging_until, 2, ("exchanged", group.worker.index))
        self._kick(group, now)

    def _retire(self, e: Engine) -> None:
        self.preemptions_gone += e.worker.preemptions
        del self.engines[e.worker.index]
        self.hooks.pop(e.worker.index, None)

    def _split(self, eng: Engine, now: float) -> None:
        settle(eng.worker, now)
        eng.worker.finished.clear()
        moved = take_all(eng.worker)
        self._retire(eng)
        parts = [self._new_engine([m], now) for m in eng.members]
        for req, ctx, gen in sorted(moved.decoding, key=lambda d: -d[1]):  # largest first, to the emptiest
            put_decoding(min(parts, key=lambda p: p.worker.used).worker, req, ctx, gen)
        rest = moved.prefilling + moved.waiting
        for i, req in enumerate(sorted(rest, key=lambda r: r.order)):
            target = parts[i % len(parts)].worker
            req.computed = 0  # its partial prefill KV is re-prefilled on the member (no exchange for it)
            target.waiting.append(req)
            target.queued_tokens += req.to_prefill
            req.worker = target.worker_id
        for p in parts:
            p.worker.waiting = type(p.worker.waiting)(sorted(p.worker.waiting, key=lambda r: r.order))
            self._kick(p, now)
        self.restores += 1

    @property
    def migrations(self) -> int:
        return self.migration.moved

    @property
    def preemptions(self) -> int:
        return self.preemptions_gone + sum(e.worker.preemptions for e in self.engines.values())

    @property
    def kv_peak(self) -> float:
        """The fullest any instance's KV got (sampled)."""
        return max((s.kv_used_max for s in self.samples), default=0.0)

    # --- the controllers ---------------------------------------------------------------------
    def _loads(self) -> list[InstanceLoad]:
        """Each instance as KunServe's monitor sees it; a group's KV is shared evenly by the members
        that dropped so far. Queued prompts count as KV demand only where the head of the queue is
        blocked on memory (KunServe's trigger: pending >= free, at >= 95% usage)."""
        loads = []
        for eid, e in self.engines.items():
            w, k = e.worker, len(e.members)
            here = e.members if e.joined is None else e.joined
            n = max(1, len(here))
            used = w.used * self.block_bytes
            growth = (w.used - self.prev_used.get(eid, w.used)) * self.block_bytes / self.cfg.tick_s
            self.prev_used[eid] = w.used
            queued = w.queued_tokens * self.profile.worker.kv_bytes_per_token if w.blocked_on == "memory" else 0
            per = self.num_layers // k
            for m in here:
                j = e.members.index(m)
                kept = None if k == 1 else (j * per, self.num_layers if j == k - 1 else (j + 1) * per)
                loads.append(InstanceLoad(
                    instance_id=f"i{m}", worker_id=f"w{m}", model=self.model, num_layers=self.num_layers,
                    layer_bytes=self.layer_bytes, kv_capacity_bytes=w.total * self.block_bytes // n,
                    kv_used_bytes=used // n, kv_growth_bytes_per_s=growth / n, queued_kv_bytes=queued // n,
                    kept_layers=kept, group_id=None if k == 1 else f"g{eid}"))
        return loads

    def _rebalance(self, now: float) -> None:
        """§4.3: a group's queued requests beyond its batch limit go back to the dispatcher, which
        sends them (newest first) to engines with batch room and free KV for them."""
        for g in [e for e in self.engines.values() if len(e.members) > 1 and not e.draining]:
            others = [e.worker for e in self.engines.values() if e is not g and not e.draining]
            for req, target in overflow(g.worker, others):
                self.overflowed += 1
                end = target.enqueue(req, now)
                if end is not None:
                    self._at(end, 0, (target.index, target.gen))
                target.finished.clear()

    def _kunserve_tick(self, now: float) -> None:
        loads = self._loads()
        self.state, action = mon.step(self.state, loads, now, self.cfg.monitor)
        if action in (mon.Action.DROP, mon.Action.ESCALATE):
            plan = plan_drop(loads, self.pipeline, strategy=self.cfg.strategy, horizon_s=self.cfg.monitor.horizon_s)  # type: ignore[arg-type]
            for group in plan.groups:
                self._merge([int(m.member.instance_id[1:]) for m in group.members], now)
            if action == mon.Action.DROP and not plan.groups:
                self.state = mon.drop_failed(self.state, now)
        elif action == mon.Action.RESTORE:
            groups = [e for e in self.engines.values() if len(e.members) > 1]
            if not groups:
                self.state = mon.restored(self.state, now)
            for e in groups:
                k = len(e.members)
                reload = self.moves.layer_restore_s((k - 1) * self.num_layers * self.layer_bytes // k)
                back = self.moves.kv.transfer_s(int(e.worker.used * self.block_bytes * (k - 1) / k))
                e.restoring = True
                self._at(now + reload + back, 3, ("restore", e.worker.index))
        elif action == mon.Action.CANCEL_RESTORE:
            for e in self.engines.values():
                e.restoring = False
        if self.state.phase != mon.Phase.NORMAL:
            self._rebalance(now)

    def _restore_done(self, eid: int, now: float) -> None:
        eng = self.engines.get(eid)
        if eng is None or not eng.restoring or self.state.phase != mon.Phase.RESTORING:
            return
        if eng.joined is not None:  # a member has not dropped yet: look again in a second
            self._at(now + 1.0, 3, ("restore", eid))
            return
        k, spec = len(eng.members), self.profile.worker
        if eng.worker.used > 0.9 * k * spec.kv_blocks:  # would not fit back: keep the group
            eng.restoring = False
            return
        eng.restoring = False
        eng.draining = True

        def split(t: float) -> None:
            self._split(eng, t)
            if self.state.phase == mon.Phase.RESTORING and not any(len(e.members) > 1 for e in self.engines.values()):
                self.state = mon.restored(self.state, t)

        self.at_boundary(eng, now, split)

    # --- the run -----------------------------------------------------------------------------
    def _route(self, req: SimRequest, now: float) -> None:
        def free(e: Engine) -> float:
            w = e.worker
            return (w.total - w.used - w.queued_tokens / w.bs) / w.total

        ready = [e for e in self.engines.values() if not e.draining]
        if not ready:  # every engine is between steps for a merge: queue without starting a step
            eng = max(self.engines.values(), key=lambda e: (free(e), -e.worker.index))
            w = eng.worker
            req.worker = w.worker_id
            w.waiting.append(req)
            w.queued_tokens += req.to_prefill
            return
        eng = max(ready, key=lambda e: (free(e), -e.worker.index))
        end = eng.worker.enqueue(req, now)
        if end is not None:
            self._at(end, 0, (eng.worker.index, eng.worker.gen))
        eng.worker.finished.clear()

    def run(self, progress: Callable[[str], None] | None = None) -> list[SimRequest]:
        records = self.trace.records
        requests = [SimRequest(i, r.request_id or f"req-{i}", r.model, None, r.arrival_s, r.prompt_tokens,
                               r.output_tokens) for i, r in enumerate(records)]
        for r in requests:
            r.output = max(1, min(r.output, self.profile.worker.max_model_len - r.prompt))
            self._at(r.arrival + self.profile.request_overhead_s, 1, r)
        end_arrivals = records[-1].arrival_s if records else 0.0
        if self.cfg.system in ("kunserve", "migration"):
            self._at(self.cfg.tick_s, 5, None)
        self._at(0.0, 6, None)
        last = 0.0
        while self.events:
            t, _, kind, payload = heappop(self.events)
            if any(len(e.members) > 1 for e in self.engines.values()):
                self.grouped_time += t - last
            last = t
            if kind == 0:
                eid, gen = payload  # type: ignore[misc]
                eng = self.engines.get(eid)
                if eng is None or eng.worker.gen != gen:
                    continue
                eng.worker.complete(t)
                eng.worker.finished.clear()
                for fn in self.hooks.pop(eid, ()):
                    fn(t)
                self._kick(eng, t)
            elif kind == 1:
                self._route(payload, t)  # type: ignore[arg-type]
            elif kind == 2:
                eng = self.engines.get(payload[1])  # type: ignore[index]
                if eng is not None and t + 1e-9 >= eng.exchanging_until:
                    def exchanged(t: float, eng: Engine = eng) -> None:
                        settle(eng.worker, t)
                        set_cost(eng.worker, group_cost(self.profile.step, len(eng.members), self.link, self.pipe))
                        self._kick(eng, t)
                    self.at_boundary(eng, t, exchanged)
            elif kind == 3:
                self._restore_done(payload[1], t)  # type: ignore[index]
            elif kind == 4:
                self.migration.event(payload, t)  # type: ignore[arg-type]
            elif kind == 5:
                if self.cfg.system == "kunserve":
                    self._kunserve_tick(t)
                else:
                    self.migration.tick(t)
                busy = any(e.worker.busy or e.worker.waiting for e in self.engines.values())
                if t < end_arrivals or busy:
                    self._at(t + self.cfg.tick_s, 5, None)
            elif kind == 6:
                self.samples.append(sample_workers(t, [e.worker for e in self.engines.values()], self.preemptions))
                busy = any(e.worker.busy or e.worker.waiting for e in self.engines.values())
                if t < end_arrivals or busy:
                    self._at(t + self.sample_s, 6, None)
        return requests


__all__ = ["SYSTEMS", "BuddyCluster", "ClusterConfig", "Engine"]
