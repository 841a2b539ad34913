"""KunServe's monitor (§4.3): drop when KV demand 1 s ahead passes capacity; restore after the
burst, with hysteresis; a burst returning mid-restore cancels it; more pressure escalates."""
from __future__ import annotations

import pytest

from shared.policy.kunserve_load import InstanceLoad
from shared.policy.kunserve_monitor import Action, MonitorConfig, MonitorState, Phase, drop_failed, restored, step

GB = 10**9
CONFIG = MonitorConfig(horizon_s=1.0, drop_watermark=1.0, restore_watermark=0.7, restore_hold_s=5.0,
                       min_dropped_s=2.0, settle_s=1.0)


def load(name: str, *, used: float, growth: float = 0.0, queued: float = 0.0, capacity: float = 50,
         dropped: bool = False) -> InstanceLoad:
    """An instance of a 48-layer model with 0.5 GB layers; `dropped`: it keeps half (24 layers, 12 GB
    more KV)."""
    return InstanceLoad(instance_id=name, worker_id=f"w-{name}", model="m", num_layers=48, layer_bytes=GB // 2,
                        kv_capacity_bytes=int((capacity + (12 if dropped else 0)) * GB), kv_used_bytes=int(used * GB),
                        kv_growth_bytes_per_s=growth * GB, queued_kv_bytes=int(queued * GB),
                        kept_layers=(0, 24) if dropped else None, group_id="bg-0" if dropped else None)


def dropped_state(at: float = 0.0) -> MonitorState:
    state, action = step(MonitorState(), [load("a", used=60)], at, CONFIG)
    assert action == Action.DROP
    return state


def test_drop_when_demand_one_second_ahead_passes_capacity() -> None:
    s = MonitorState()
    assert step(s, [load("a", used=40), load("b", used=48)], 0.0, CONFIG) == (s, Action.NONE)
    # under capacity now, over it in one second: KV grows 3 GB/s from 48 GB of 50 (96% used)
    state, action = step(s, [load("a", used=40), load("b", used=48, growth=3)], 0.0, CONFIG)
    assert action == Action.DROP and state.phase == Phase.DROPPED and state.since == 0.0
    # the same growth reaching capacity in 2 s is not a trigger yet (§4.3's tight 1 s threshold)
    assert step(s, [load("b", used=48, growth=1)], 0.0, CONFIG)[1] == Action.NONE
    # queued prompts count: 48 GB running + 3 GB of prompts waiting
    assert step(s, [load("b", used=48, queued=3)], 0.0, CONFIG)[1] == Action.DROP
    # shrinking KV does not offset the queue; a longer horizon sees further
    assert step(s, [load("b", used=48, growth=-20, queued=3)], 0.0, CONFIG)[1] == Action.DROP
    far = MonitorConfig(horizon_s=3.0)
    assert step(s, [load("b", used=48, growth=1)], 0.0, far)[1] == Action.DROP


def test_a_compute_backlog_with_kv_to_spare_does_not_drop() -> None:
    # KunServe's code drops only at >= 95% KV usage: 45 of 50 GB (90%) with 20 GB of prompts queued
    # is a prefill backlog, not memory throttling
    s = MonitorState()
    assert step(s, [load("b", used=45, queued=20)], 0.0, CONFIG)[1] == Action.NONE
    assert step(s, [load("b", used=47.5, queued=20)], 0.0, CONFIG)[1] == Action.DROP
    assert step(s, [load("b", used=45, queued=20)], 0.0, MonitorConfig(min_usage=0.0))[1] == Action.DROP
    with pytest.raises(ValueError, match="min_usage"):
        MonitorConfig(min_usage=1.5)


def test_available_memory_shrinking_counts_too() -> None:
    shrinking = InstanceLoad(instance_id="a", worker_id="w", model="m", num_layers=4, layer_bytes=1,
                             kv_capacity_bytes=50 * GB, kv_used_bytes=48 * GB, capacity_change_bytes_per_s=-6 * GB)
    assert step(MonitorState(), [shrinking], 0.0, CONFIG)[1] == Action.DROP


def test_restore_only_after_the_burst_has_passed_for_the_hold_time() -> None:
    state = dropped_state(0.0)
    calm = [load("a", used=20, dropped=True), load("b", used=20, dropped=True)]  # 40 of 100 restored: 0.4
    state, action = step(state, calm, 1.0, CONFIG)
    assert action == Action.NONE and state.calm_since == 1.0
    state, action = step(state, calm, 5.9, CONFIG)
    assert action == Action.NONE
    state, action = step(state, calm, 6.0, CONFIG)
    assert action == Action.RESTORE and state.phase == Phase.RESTORING
    assert restored(state, 9.0) == MonitorState(Phase.NORMAL, since=9.0)


def test_hysteresis_between_the_watermarks_keeps_the_groups() -> None:
    state = dropped_state(0.0)
    # 80 GB of 100 restored capacity: below the drop watermark, above the restore one
    middle = [load("a", used=40, dropped=True), load("b", used=40, dropped=True)]
    for t in range(1, 30):
        state, action = step(state, middle, float(t), CONFIG)
        assert action == Action.NONE and state.phase == Phase.DROPPED and state.calm_since is None
    # a calm spell broken by a spike starts the hold over
    calm = [load("a", used=20, dropped=True), load("b", used=20, dropped=True)]
    state, _ = step(state, calm, 30.0, CONFIG)
    state, _ = step(state, middle, 33.0, CONFIG)
    state, _ = step(state, calm, 34.0, CONFIG)
    assert step(state, calm, 38.0, CONFIG)[1] == Action.NONE
    assert step(state, calm, 39.0, CONFIG)[1] == Action.RESTORE


def test_no_restore_right_after_the_drop() -> None:
    state = dropped_state(0.0)
    calm = [load("a", used=1, dropped=True)]
    quick = MonitorConfig(restore_hold_s=0.0, min_dropped_s=2.0)
    state, action = step(state, calm, 1.0, quick)
    assert action == Action.NONE
    assert step(state, calm, 2.0, quick)[1] == Action.RESTORE


def test_a_burst_returning_mid_restore_cancels_it() -> None:
    state = dropped_state(0.0)
    calm = [load("a", used=20, dropped=True), load("b", used=20, dropped=True)]
    state, _ = step(state, calm, 1.0, CONFIG)
    state, action = step(state, calm, 6.0, CONFIG)
    assert action == Action.RESTORE
    assert step(state, calm, 7.0, CONFIG)[1] == Action.NONE  # restoring: nothing new to do
    burst = [load("a", used=52, dropped=True), load("b", used=50, dropped=True)]  # 102 > 100 restored
    state, action = step(state, burst, 8.0, CONFIG)
    assert action == Action.CANCEL_RESTORE and state == MonitorState(Phase.DROPPED, since=8.0)
    with pytest.raises(ValueError, match="not restoring"):
        restored(state, 9.0)


def test_escalate_when_the_groups_are_not_enough_once_settled() -> None:
    state = dropped_state(0.0)
    # an instance left unsplit throttles while the others are grouped
    loads = [load("a", used=30, dropped=True), load("b", used=30, dropped=True), load("c", used=55)]
    assert step(state, loads, 0.5, CONFIG)[1] == Action.NONE  # the drop is still settling
    assert step(state, loads, 1.0, CONFIG)[1] == Action.ESCALATE
    # the grouped ones together past their enlarged capacity (2 x 62 GB)
    full = [load("a", used=63, dropped=True), load("b", used=62, dropped=True)]
    state, action = step(state, full, 1.5, CONFIG)
    assert action == Action.ESCALATE and state.phase == Phase.DROPPED


def test_a_failed_drop_returns_to_normal_and_triggers_again() -> None:
    state = drop_failed(dropped_state(0.0), 0.5)
    assert state == MonitorState(Phase.NORMAL, since=0.5)
    assert step(state, [load("a", used=60)], 1.0, CONFIG)[1] == Action.DROP
    with pytest.raises(ValueError, match="not dropped"):
        drop_failed(state, 2.0)


def test_bad_config_and_time_are_named() -> None:
    with pytest.raises(ValueError, match="restore_watermark"):
        MonitorConfig(drop_watermark=0.8, restore_watermark=0.8)
    with pytest.raises(ValueError, match="drop_watermark"):
        MonitorConfig(drop_watermark=0.0)
    with pytest.raises(ValueError, match="horizon_s"):
        MonitorConfig(horizon_s=-1)
    with pytest.raises(ValueError, match="backwards"):
        step(MonitorState(Phase.DROPPED, since=5.0), [load("a", used=1)], 4.0, CONFIG)
