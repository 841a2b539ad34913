"""KunServe's online monitor (§4.3) as a pure state machine: when to drop, when to restore.

Drop: an instance whose KV demand `horizon_s` ahead (1 s: "when the future KVCache usage is
about to exceed the available HBM in one second") passes `drop_watermark` of its projected
capacity while its KV is at least `min_usage` (95%, as KunServe's code checks) full: queued prompts
count in the demand, but a compute backlog with KV to spare does not trigger a drop. The tight horizon is the paper's: dropping is instant, so dropping early gains
little and costs pipeline overhead on a false alarm.

Restore, with hysteresis (the paper says "the burst has passed"; the thresholds are ours):
the model's summed projected demand must fit within `restore_watermark` (< drop_watermark) of
the KV capacity it would have with every layer back (capacity - dropped bytes), continuously
for `restore_hold_s`, and not before `min_dropped_s` after the drop. A burst that returns while
restoring (projected demand past `drop_watermark` of the restored capacity) cancels the restore.
While dropped, an instance left unsplit that throttles, or a summed demand past the capacity
*with* the groups, asks for more (`escalate`: plan the unsplit ones, or scale out) -- not in the
first `settle_s` after the drop, while the freed bytes are still turning into KV blocks.

Phases: normal -(drop)-> dropped -(restore)-> restoring -(restored())-> normal, and
restoring -(cancel_restore)-> dropped; `drop_failed()` returns a dropped model to normal.
One `MonitorState` per model; `step` returns the next state and what to do. Pure: `now` is an
argument.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from shared.policy.kunserve_load import DEFAULT_HORIZON_S, InstanceLoad


class Phase(StrEnum):
    NORMAL = "normal"
    DROPPED = "dropped"
    RESTORING = "restoring"


class Action(StrEnum):
    NONE = "none"
    DROP = "drop"  # plan and apply a drop (kunserve.plan_drop)
    ESCALATE = "escalate"  # dropped, and the groups are not enough: more groups or scale out
    RESTORE = "restore"  # restore dropped layers, migrate back, dissolve the groups
    CANCEL_RESTORE = "cancel_restore"  # the burst came back mid-restore: keep the groups


@dataclass(frozen=True, slots=True)
class MonitorConfig:
    horizon_s: float = DEFAULT_HORIZON_S
    drop_watermark: float = 1.0  # projected demand / projected capacity that triggers a drop
    # ... and only while the instance's KV is at least this full: KunServe's code drops at >= 95% KV
    # usage, so a compute backlog (queued prompts with KV to spare) never triggers a drop
    min_usage: float = 0.95
    restore_watermark: float = 0.7  # summed demand / restored capacity under which a restore may start
    restore_hold_s: float = 5.0  # ... for this long without a break
    min_dropped_s: float = 2.0  # no restore sooner than this after a drop (no flapping)
    settle_s: float = 1.0  # no escalation sooner than this after a drop (stats catch up)

    def __post_init__(self) -> None:
        if self.horizon_s < 0:
            raise ValueError(f"horizon_s must be >= 0, got {self.horizon_s}")
        if not 0 < self.drop_watermark <= 1.5:
            raise ValueError(f"drop_watermark must be in (0, 1.5], got {self.drop_watermark}")
        if not 0 <= self.min_usage <= 1:
            raise ValueError(f"min_usage must be in [0, 1], got {self.min_usage}")
        if not 0 < self.restore_watermark < self.drop_watermark:
            raise ValueError(f"restore_watermark must be in (0, drop_watermark={self.drop_watermark}), "
                             f"got {self.restore_watermark}: without the gap the monitor would flap")
        if min(self.restore_hold_s, self.min_dropped_s, self.settle_s) < 0:
            raise ValueError("restore_hold_s, min_dropped_s and settle_s must be >= 0")


@dataclass(frozen=True, slots=True)
class MonitorState:
    phase: Phase = Phase.NORMAL
    since: float = 0.0  # when the phase began
    calm_since: float | None = None  # while dropped: since when the restore condition has held


@dataclass(frozen=True, slots=True)
class Pressure:
    """One model's memory pressure `horizon_s` ahead, from its instances' loads."""

    demand: float  # summed projected KV demand
    capacity: float  # summed projected KV capacity now (with dropped layers' bytes)
    restored_capacity: float  # what it would be with every layer restored
    throttled: tuple[str, ...]  # instances whose own demand passes the drop watermark
    throttled_unsplit: tuple[str, ...]  # ... of them, those in no group

    @classmethod
    def of(cls, loads: Sequence[InstanceLoad], config: MonitorConfig) -> Pressure:
        h = config.horizon_s
        throttled = [l for l in loads if l.projected_demand(h) > config.drop_watermark * l.projected_capacity(h)
                     and l.kv_used_bytes >= config.min_usage * l.kv_capacity_bytes]
        return cls(
            demand=sum(l.projected_demand(h) for l in loads),
            capacity=sum(l.projected_capacity(h) for l in loads),
            restored_capacity=sum(max(0.0, l.projected_capacity(h) - l.dropped_bytes) for l in loads),
            throttled=tuple(sorted(l.instance_id for l in throttled)),
            throttled_unsplit=tuple(sorted(l.instance_id for l in throttled if not l.grouped)))


def step(state: MonitorState, loads: Sequence[InstanceLoad], now: float,
         config: MonitorConfig = MonitorConfig()) -> tuple[MonitorState, Action]:
    """One observation of a model's instances at `now`: the next state and the action to take."""
    if now < state.since:
        raise ValueError(f"time went backwards: now={now} < phase start {state.since}")
    p = Pressure.of(loads, config)
    if state.phase == Phase.NORMAL:
        if p.throttled:
            return MonitorState(Phase.DROPPED, since=now), Action.DROP
        return state, Action.NONE
    if state.phase == Phase.RESTORING:
        if p.demand > config.drop_watermark * p.restored_capacity:
            return MonitorState(Phase.DROPPED, since=now), Action.CANCEL_RESTORE
        return state, Action.NONE
    # dropped
    if p.throttled_unsplit or p.demand > config.drop_watermark * p.capacity:
        settled = now - state.since >= config.settle_s
        return replace(state, calm_since=None), Action.ESCALATE if settled else Action.NONE
    if p.demand > config.restore_watermark * p.restored_capacity:
        return replace(state, calm_since=None), Action.NONE
    calm_since = now if state.calm_since is None else state.calm_since
    if now - calm_since >= config.restore_hold_s and now - state.since >= config.min_dropped_s:
        return MonitorState(Phase.RESTORING, since=now), Action.RESTORE
    return replace(state, calm_since=calm_since), Action.NONE


def restored(state: MonitorState, now: float) -> MonitorState:
    """Every layer is back and the groups dissolved: the model runs unsplit again."""
    if state.phase != Phase.RESTORING:
        raise ValueError(f"restored() while {state.phase}, not restoring")
    return MonitorState(Phase.NORMAL, since=now)


def drop_failed(state: MonitorState, now: float) -> MonitorState:
    """The drop was not applied (no group could form): back to normal, so the next throttled
    observation triggers again."""
    if state.phase != Phase.DROPPED:
        raise ValueError(f"drop_failed() while {state.phase}, not dropped")
    return MonitorState(Phase.NORMAL, since=now)


__all__ = ["Action", "MonitorConfig", "MonitorState", "Phase", "Pressure", "drop_failed", "restored", "step"]
