"""One buddy group's life as the planner drives it: form, drop, restore, migrate back, dissolve.

A `GroupSteps` holds what the planner has *applied* to one group (outcomes, not intentions) and,
each time it is asked (`next_steps`), returns the actions that move the group toward its target:

    forming --FormGroup applied--> dropping --every planned range dropped--> active
    active --target restored--> restoring: RestoreInstanceLayers for every dropped range
           --every range back--> dissolving: DissolveGroup (LeaveGroup on every member) --applied--> gone

Migrate-back needs no action: a member holding every layer again pulls its requests' KV home by
itself (services/gpu_worker/group/migrate_back.py) and refuses LeaveGroup `busy` until nothing
would be lost, so DissolveGroup is retried every interval until every member has left.

The target is one of two consistent states: *dropped* (every member keeps only its stage) or
*restored* (every layer back, then dissolved). A burst that returns mid-restore flips the target
back to dropped before DissolveGroup is dispatched: no new restore or migration is started, the
ones in flight end, and every range restored so far is dropped again, so the group ends as it was
before the restore. Once DissolveGroup is dispatched the group is committed to dissolving (retried
every interval until applied: LeaveGroup is idempotent); a new drop regroups if pressure persists.

A member's two dropped ranges (a middle stage) go one after the other: one effect per instance
in flight. A FormGroup or a DropInstanceLayers that fails sends the group to `cleanup`
(DissolveGroup: leaving restores what was dropped); a RestoreInstanceLayers that fails (a worker
without RestoreLayers answers `unsupported`) skips to dissolving, whose LeaveGroup restores the
layers. A failed step is retried at the next planning interval, never at once. Pure: no I/O, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from shared.events.common import GroupMember, LayerRange
from shared.events.plan import (
    DissolveGroup, DropInstanceLayers, FormGroup, Migrate, PlanAction, RestoreInstanceLayers,
)
from shared.planner.effects import key
from shared.planner.policy import Busy
from shared.planner.view import ClusterView

Range = tuple[int, int]


class GroupPhase(StrEnum):
    FORMING = "forming"
    DROPPING = "dropping"  # also: dropping again after a cancelled restore
    ACTIVE = "active"
    RESTORING = "restoring"
    MIGRATING = "migrating"
    DISSOLVING = "dissolving"
    CLEANUP = "cleanup"  # formation or a drop failed: dissolve what exists
    GONE = "gone"


@dataclass
class GroupSteps:
    group_id: str
    model: str
    members: list[GroupMember]  # in layer order: members[0] is the entry
    planned: dict[str, list[Range]]  # instance -> the ranges it drops when the group is dropped
    phase: GroupPhase = GroupPhase.FORMING
    dropped: dict[str, list[Range]] = field(default_factory=dict)  # instance -> ranges dropped (applied)
    inflight: set[tuple] = field(default_factory=set)  # our actions in flight, by `step_id`
    migrated: set[str] = field(default_factory=set)  # requests migrate-back was decided for (this restore)
    want_restore: bool = False
    dissolve_attempts: int = 0
    failure: str = ""  # why the group went to cleanup
    held: bool = False  # a step failed: the next one waits for the next interval (no tight retry loop)

    @classmethod
    def adopted(cls, group_id: str, model: str, members: list[GroupMember], num_layers: int) -> GroupSteps:
        """A group found running (formed by an earlier planner): active, its drops from its members' layers."""
        dropped = {m.instance_id: _complement(num_layers, m.layers) for m in members}
        return cls(group_id, model, members, planned=dropped, phase=GroupPhase.ACTIVE,
                   dropped={k: list(v) for k, v in dropped.items()})

    @property
    def instances(self) -> set[str]:
        return {m.instance_id for m in self.members}

    # --- outcomes ------------------------------------------------------------------------
    def ended(self, action: PlanAction, applied: bool, why: str = "") -> None:
        """One of this group's actions ended (applied, or failed / cancelled: nothing of it stands)."""
        self.inflight.discard(step_id(action))
        self.held = self.held or not applied
        match action:
            case FormGroup():
                if applied:
                    self.phase = GroupPhase.DROPPING
                else:  # some members may have joined before the one that refused: dissolve what exists
                    self._fail(f"formation failed: {why}")
            case DropInstanceLayers():
                if applied:
                    self.dropped.setdefault(action.instance_id, []).append((action.layers.start, action.layers.end))
                elif self.phase in (GroupPhase.DROPPING, GroupPhase.FORMING):
                    self._fail(f"dropping layers of {action.instance_id} failed: {why}")
            case RestoreInstanceLayers():
                if applied:
                    ranges = self.dropped.get(action.instance_id, [])
                    span = (action.layers.start, action.layers.end)
                    if span in ranges:
                        ranges.remove(span)
                elif self.phase == GroupPhase.RESTORING:  # e.g. RestoreLayers unsupported by the worker
                    self.failure = f"restoring layers of {action.instance_id} failed ({why}); leaving restores them"
                    self.phase = GroupPhase.DISSOLVING
            case DissolveGroup():
                if applied:
                    self.phase = GroupPhase.GONE
                else:
                    self.dissolve_attempts += 1

    def _fail(self, why: str) -> None:
        self.failure = why
        self.phase = GroupPhase.CLEANUP

    # --- the next actions ---------------------------------------------------------------------
    def next_steps(self, view: ClusterView, busy: Busy, *, interval: bool) -> list[tuple[PlanAction, str]]:
        """Actions (with why) that move the group toward its target now. `interval`: asked at the planning
        interval (a failed step is retried only then), not right after an outcome."""
        if interval:
            self.held = False
        if self.phase in (GroupPhase.FORMING, GroupPhase.GONE) or self.held:
            return []
        if self.phase in (GroupPhase.CLEANUP, GroupPhase.DISSOLVING):
            return self._dissolve(busy)
        if self.want_restore:
            return self._toward_restored(view, busy)
        return self._toward_dropped(busy)

    def _toward_dropped(self, busy: Busy) -> list[tuple[PlanAction, str]]:
        if self.phase in (GroupPhase.RESTORING, GroupPhase.MIGRATING):
            self.phase = GroupPhase.DROPPING  # the restore was cancelled: drop what came back
            self.migrated.clear()
        out: list[tuple[PlanAction, str]] = []
        for m in self.members:
            todo = [r for r in self.planned.get(m.instance_id, []) if r not in self.dropped.get(m.instance_id, [])]
            if not todo:
                continue
            action = DropInstanceLayers(worker_id=m.worker_id, instance_id=m.instance_id, group_id=self.group_id,
                                        layers=LayerRange(start=todo[0][0], end=todo[0][1]))
            if self._free(action, busy, member=m.instance_id):
                out.append((action, f"{m.instance_id} keeps layers [{m.layers.start}, {m.layers.end}) of "
                                    f"{self.group_id}: its layers [{todo[0][0]}, {todo[0][1]}) become KV blocks"))
        if not out and not self._member_busy() and self.phase == GroupPhase.DROPPING:
            if all(sorted(self.dropped.get(i, [])) == sorted(r) for i, r in self.planned.items()):
                self.phase = GroupPhase.ACTIVE
        return out

    def _toward_restored(self, view: ClusterView, busy: Busy) -> list[tuple[PlanAction, str]]:
        if self.phase in (GroupPhase.ACTIVE, GroupPhase.DROPPING):
            self.phase = GroupPhase.RESTORING
        if self.phase == GroupPhase.RESTORING:
            out: list[tuple[PlanAction, str]] = []
            for m in self.members:
                ranges = self.dropped.get(m.instance_id, [])
                if not ranges:
                    continue
                start, end = ranges[0]
                action = RestoreInstanceLayers(worker_id=m.worker_id, instance_id=m.instance_id,
                                               layers=LayerRange(start=start, end=end))
                if self._free(action, busy, member=m.instance_id):
                    out.append((action, f"the burst has passed: {m.instance_id} of {self.group_id} loads layers "
                                        f"[{start}, {end}) back"))
            if out or self._member_busy() or any(self.dropped.values()):
                return out
            self.phase = GroupPhase.DISSOLVING  # the members migrate their requests back themselves
        return self._dissolve(busy)

    def _dissolve(self, busy: Busy) -> list[tuple[PlanAction, str]]:
        action = DissolveGroup(group_id=self.group_id)
        if self.inflight or busy.has(key(action)):
            return []
        self.inflight.add(step_id(action))
        why = self.failure or "every layer is back and the requests left the pipeline"
        return [(action, f"dissolve {self.group_id}: {why}")]

    def _free(self, action: PlanAction, busy: Busy, *, member: str) -> bool:
        """Take the step unless the member has one in flight (ours or anyone's on that key)."""
        if busy.has(key(action)) or any(s[0] in ("drop", "restore") and s[1] == member for s in self.inflight):
            return False
        self.inflight.add(step_id(action))
        return True

    def _member_busy(self) -> bool:
        return any(s[0] in ("drop", "restore") for s in self.inflight)


def step_id(action: PlanAction) -> tuple:
    """What identifies one of a group's actions while in flight."""
    match action:
        case DropInstanceLayers():
            return ("drop", action.instance_id, action.layers.start, action.layers.end)
        case RestoreInstanceLayers():
            return ("restore", action.instance_id, action.layers.start, action.layers.end)
        case Migrate():
            return ("migrate", action.request_id)
        case FormGroup():
            return ("form", action.group_id)
        case DissolveGroup():
            return ("dissolve", action.group_id)
    return ("other", repr(action))


def _complement(num_layers: int, kept: LayerRange) -> list[Range]:
    return [r for r in ((0, kept.start), (kept.end, num_layers)) if r[1] > r[0]]


__all__ = ["GroupPhase", "GroupSteps", "Range", "step_id"]
