"""KunServe as a planner policy: per model, the monitor says when, the drop plan says how, and each
buddy group's steps (`kunserve_group_steps`) become effects.

Every interval (`decide`), per model served by usable workers with a catalog record:
1. Its instances become `InstanceLoad`s (KV capacity, use, growth, queued prompts' KV, the layers it
   keeps, its group). An instance's capacity counts its share of the worker's prewarmed bytes: the
   pool gives those up for KV on demand (the cheaper source, DESIGN §1), so layers are dropped only
   for what evicting them cannot cover.
2. `kunserve_monitor.step` on the loads. `drop` / `escalate`: `plan_drop` over the instances in no
   group; each planned group is a FormGroup now and, once applied, DropInstanceLayers per dropped
   range (`follow_ups`, at once: not a planning interval later). `restore`: every group of the model
   targets *restored* (restore, migrate back, dissolve). `cancel_restore`: back to *dropped*.
3. The monitor is told how it went: a model whose groups all failed to form is `drop_failed` (and not
   planned again for `retry_after_s`); one whose groups all dissolved after a restore is `restored`.
A group found running that this policy did not form (an earlier planner's) is adopted as active.

`[policies] buddy_groups = false`: the planner service does not construct this policy at all.
Pure: no I/O, no clock (time is `view.now`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.events.common import GroupMember, LayerRange
from shared.events.plan import FormGroup, PlanApplied, PlanOutcome
from shared.events.registry import ModelRecord
from shared.planner.effects import Decision, Effect, action_of, key
from shared.planner.kunserve_group_steps import GroupPhase, GroupSteps, step_id
from shared.planner.policy import Busy
from shared.planner.view import ClusterView, InstanceView, WorkerView
from shared.policy import kunserve_monitor as monitor
from shared.policy.kunserve import Strategy, plan_drop
from shared.policy.kunserve_load import InstanceLoad
from shared.policy.kunserve_monitor import Action, MonitorConfig, MonitorState, Phase
from shared.policy.kunserve_profile import PipelineProfile

RETRY_AFTER_S = 10.0  # a model whose drop failed is not planned again sooner


@dataclass
class _Model:
    state: MonitorState = field(default_factory=MonitorState)
    groups: dict[str, GroupSteps] = field(default_factory=dict)
    retry_at: float = 0.0


class KunServePolicy:
    name = "kunserve"

    def __init__(self, profile: PipelineProfile, *, monitor_config: MonitorConfig = MonitorConfig(),
                 strategy: Strategy = "throughput_greedy", kv_block_tokens: int = 16, unsplit_max_batch: int = 64,
                 group_prefix: str = "bg", retry_after_s: float = RETRY_AFTER_S) -> None:
        if kv_block_tokens < 1:
            raise ValueError(f"kv_block_tokens must be >= 1, got {kv_block_tokens}")
        self.profile = profile
        self.config = monitor_config
        self.strategy: Strategy = strategy
        self.kv_block_tokens = kv_block_tokens
        self.unsplit_max_batch = unsplit_max_batch
        self.group_prefix = group_prefix
        self.retry_after_s = retry_after_s
        self.models: dict[str, _Model] = {}
        self.gone: set[str] = set()  # groups dissolved here: not adopted again while stats still name them
        self._plans = 0

    # --- the Policy protocol ----------------------------------------------------------------
    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        decisions: list[Decision] = []
        for model, instances in sorted(_serving(view).items()):
            record = view.models.get(model)
            if record is None or record.layer_bytes < 1:
                continue  # no layer sizes in the catalog: nothing to plan with
            m = self.models.setdefault(model, _Model())
            self._adopt(m, model, instances, record)
            loads = [self._load(w, i, record, m) for w, i in instances]
            decisions += self._monitor(m, model, loads, view)
        return decisions + self._steps(view, busy, interval=True)

    def follow_ups(self, view: ClusterView, busy: Busy) -> list[Decision]:
        """The groups' next steps right after an outcome (e.g. the drops once FormGroup is applied)."""
        return self._steps(view, busy, interval=False)

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        action = action_of(effect)
        sid = step_id(action)
        why = getattr(outcome, "message", "")
        for m in self.models.values():
            for group in m.groups.values():
                if sid in group.inflight:
                    group.ended(action, isinstance(outcome, PlanApplied), why)
                    return

    def on_declined(self, decision: Decision, why: str) -> None:
        """The memory arbiter did not buy a group (`[planner] economy = "arbiter"`): nothing of it was
        applied, so forget it; a model left with no group is back to normal and proposes again, re-priced."""
        action = decision.action
        if not isinstance(action, FormGroup):
            return
        m = self.models.get(action.model)
        if m is None or action.group_id not in m.groups or m.groups[action.group_id].phase != GroupPhase.FORMING:
            return
        del m.groups[action.group_id]
        if not m.groups and m.state.phase == Phase.DROPPED:
            m.state = monitor.drop_failed(m.state, m.state.since)  # not a failure: no retry delay

    # --- deciding -----------------------------------------------------------------------------
    def _monitor(self, m: _Model, model: str, loads: list[InstanceLoad], view: ClusterView) -> list[Decision]:
        now = view.now
        self._settle(m, now)
        if m.state.phase == Phase.NORMAL and now < m.retry_at:
            return []  # a drop just failed here: not again before retry_at
        m.state, act = monitor.step(m.state, loads, now, self.config)
        if act in (Action.DROP, Action.ESCALATE):
            out = self._drop(m, model, loads, now)
            self._settle(m, now)
            return out
        for group in m.groups.values():
            if act == Action.RESTORE:
                group.want_restore = True
            elif act == Action.CANCEL_RESTORE:
                group.want_restore = False
        return []

    def _settle(self, m: _Model, now: float) -> None:
        """Tell the monitor how the groups went: none left after a restore, or none formed after a drop."""
        for gid in [g for g, s in m.groups.items() if s.phase == GroupPhase.GONE]:
            del m.groups[gid]
            self.gone.add(gid)
        if m.groups:
            return
        if m.state.phase == Phase.RESTORING:
            m.state = monitor.restored(m.state, now)
        elif m.state.phase == Phase.DROPPED:
            m.state = monitor.drop_failed(m.state, now)
            m.retry_at = now + self.retry_after_s

    def _drop(self, m: _Model, model: str, loads: list[InstanceLoad], now: float) -> list[Decision]:
        self._plans += 1
        plan = plan_drop(loads, self.profile, strategy=self.strategy, horizon_s=self.config.horizon_s,
                         unsplit_max_batch=self.unsplit_max_batch, group_id_prefix=f"{self.group_prefix}-{self._plans}")
        decisions = []
        for g in plan.groups:
            members = [d.member for d in g.members]
            planned = {d.instance_id: [(r.start, r.end) for r in d.dropped] for d in g.members}
            steps = GroupSteps(g.group_id, model, members, planned)
            action = FormGroup(group_id=g.group_id, model=model, members=members)
            steps.inflight.add(step_id(action))
            m.groups[g.group_id] = steps
            decisions.append(Decision(action=action, trigger="kv_pressure", freed_bytes=g.freed_bytes,
                                      modeled_cost=plan.cost, reason=f"{g.group_id}: {g.stages} stages, frees "
                                      f"{g.freed_bytes} B, batch limit {g.max_batch}; {plan.reason}"))
        return decisions

    def _steps(self, view: ClusterView, busy: Busy, *, interval: bool) -> list[Decision]:
        out: list[Decision] = []
        taken: set = set()
        for model in sorted(self.models):
            m = self.models[model]
            for gid in sorted(m.groups):
                for action, why in m.groups[gid].next_steps(view, busy, interval=interval):
                    if key(action) in taken:  # one effect per key per call (the core would drop the second)
                        m.groups[gid].inflight.discard(step_id(action))
                        continue
                    taken.add(key(action))
                    out.append(Decision(action=action, trigger="kv_pressure", reason=why))
            self._settle(m, view.now)
        return out

    # --- what the view says --------------------------------------------------------------------
    def _adopt(self, m: _Model, model: str, instances: list[tuple[WorkerView, InstanceView]],
               record: ModelRecord) -> None:
        seen: dict[str, list[GroupMember]] = {}
        for w, i in instances:
            if i.group_id is not None and i.layers[1] > i.layers[0]:
                seen.setdefault(i.group_id, []).append(GroupMember(
                    worker_id=w.worker_id, instance_id=i.instance_id, layers=LayerRange(start=i.layers[0], end=i.layers[1])))
        self.gone &= set(seen)  # forget dissolved groups once no stats name them
        known = {gid for mm in self.models.values() for gid in mm.groups}
        for gid, members in seen.items():
            if gid in known or gid in self.gone or len(members) < 2:
                continue
            members.sort(key=lambda g: g.layers.start)
            m.groups[gid] = GroupSteps.adopted(gid, model, members, record.num_layers)
            if m.state.phase == Phase.NORMAL:
                m.state = MonitorState(Phase.DROPPED, since=0.0)  # held since before we looked

    def _load(self, worker: WorkerView, inst: InstanceView, record: ModelRecord, m: _Model) -> InstanceLoad:
        group = next((g for g in m.groups.values() if inst.instance_id in g.instances), None)
        kept = inst.layers if inst.layers[1] > inst.layers[0] else (0, record.num_layers)
        if group is not None:  # ours: its stats may not show the group yet
            member = next(x for x in group.members if x.instance_id == inst.instance_id)
            if group.phase in (GroupPhase.DROPPING, GroupPhase.ACTIVE):
                kept = (member.layers.start, member.layers.end)
        layers = kept[1] - kept[0]
        prewarm = worker.pool_bytes.get("prewarm", 0) // max(1, len(worker.instances))
        per_token = inst.kv_block_bytes * layers / self.kv_block_tokens  # a block is one layer's KV
        return InstanceLoad(
            instance_id=inst.instance_id, worker_id=worker.worker_id, model=inst.model, num_layers=record.num_layers,
            layer_bytes=record.layer_bytes, kv_capacity_bytes=inst.kv_capacity_bytes + prewarm,
            kv_used_bytes=inst.kv_used_bytes, kv_growth_bytes_per_s=inst.kv_growth_blocks_per_s * inst.kv_block_bytes,
            queued_kv_bytes=int(inst.queued_prompt_tokens * per_token),
            kept_layers=None if kept == (0, record.num_layers) else kept,
            group_id=group.group_id if group is not None else inst.group_id)

    # --- for tests and dashboards --------------------------------------------------------------
    def groups(self, model: str) -> dict[str, GroupSteps]:
        m = self.models.get(model)
        return dict(m.groups) if m is not None else {}

    def phase(self, model: str) -> Phase:
        m = self.models.get(model)
        return m.state.phase if m is not None else Phase.NORMAL


def _serving(view: ClusterView) -> dict[str, list[tuple[WorkerView, InstanceView]]]:
    """model -> (worker, instance) on usable workers, in worker id order."""
    out: dict[str, list[tuple[WorkerView, InstanceView]]] = {}
    for worker in view.usable_workers():
        for inst in worker.instances:
            if inst.kv_block_bytes > 0:
                out.setdefault(inst.model, []).append((worker, inst))
    return out


__all__ = ["KunServePolicy", "RETRY_AFTER_S"]
