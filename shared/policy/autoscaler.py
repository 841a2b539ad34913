"""The autoscaler of WarmServe's public code, as one pure policy (no I/O, no clock: time is an argument).

WarmServe (§2.1) leaves the autoscaler to "a predefined threshold"; its public code
(github.com/LLMServe/WarmServe, vllm-0.6.3.post1/vllm/entrypoints/controller/: `common.py` and
`PrewarmManager._check_engines` in `prewarm_manager.py`) fixes it, and this module is that rule:

* a model's **load** is its requests in the system (admitted, queued or running, until they finish),
  averaged over time in the last `window_s` (SCALE_WINDOW = 5 s; `ModelStatus.get_avg_load`: a step
  function integrated over the window, 0 before the first sample);
* its **capacity** is `B` requests per instance (BATCH_SIZE = 32: the controller sends an instance no
  more than B requests at once), instances counted with those still starting;
* every period (0.5 s there): load > `scale_up_at` (SCALE_UPPER_BOUND 0.8) x capacity starts
  ceil(load / 0.8 / B) - instances; load < `scale_down_at` (SCALE_LOWER_BOUND 0.5) x capacity stops
  instances - ceil(load / 0.5 / B) of them, fewest requests first, never one younger than
  `protect_s` (PROTECT_PERIOD = 5 s). A stopped instance takes no new request and ends when its
  requests have finished (its grace period); load 0 stops them all (scale to zero);
* between periods a request that finds every instance at B starts one more at once, unless a start
  is already being decided (`direct_start`; `schedule` there).

The simulator (loadgen/sim/fleet.py) and the live planner (shared/planner/warmserve_policy.py) both
call `decide` with their own view of the instances; `LoadWindow` keeps the samples.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleParams:
    batch_size: int = 32  # B: requests one instance takes at once (common.py BATCH_SIZE)
    scale_up_at: float = 0.8  # SCALE_UPPER_BOUND
    scale_down_at: float = 0.5  # SCALE_LOWER_BOUND
    window_s: float = 5.0  # SCALE_WINDOW: the load is averaged over this long
    protect_s: float = 5.0  # PROTECT_PERIOD: an instance younger than this is never stopped
    period_s: float = 0.5  # check_engine_loop: how often the rule runs

    def __post_init__(self) -> None:
        if self.batch_size < 1 or not 0 < self.scale_down_at < self.scale_up_at:
            raise ValueError(f"autoscaler: need batch_size >= 1 and 0 < scale_down_at < scale_up_at "
                             f"(got {self.batch_size}, {self.scale_down_at}, {self.scale_up_at})")
        if self.window_s <= 0 or self.protect_s < 0 or self.period_s <= 0:
            raise ValueError(f"autoscaler: need window_s > 0, protect_s >= 0, period_s > 0 "
                             f"(got {self.window_s}, {self.protect_s}, {self.period_s})")


class LoadWindow:
    """A model's load as a step function of time; `mean(now)` is its average over the last `window_s`."""

    __slots__ = ("window_s", "_points")

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._points: deque[tuple[float, float]] = deque()  # (since, load), times ascending

    def record(self, t: float, load: float) -> None:
        """From `t` on the load is `load` (samples must come in time order)."""
        points = self._points
        if points and t < points[-1][0]:
            raise ValueError(f"load sample at {t} is older than the last one ({points[-1][0]})")
        if points and points[-1][0] == t:
            points.pop()
        if not points or points[-1][1] != load:
            points.append((t, load))
        start = t - self.window_s
        while len(points) >= 2 and points[1][0] <= start:
            points.popleft()  # the older point no longer shapes the window

    def mean(self, now: float) -> float:
        start = now - self.window_s
        total, prev_t, prev_load = 0.0, start, 0.0
        for t, load in self._points:
            if t > now:
                break
            if t > start:
                total += prev_load * (t - prev_t)
                prev_t = t
            prev_load = load
        total += prev_load * (now - prev_t)
        return total / self.window_s

    @property
    def last(self) -> float:
        return self._points[-1][1] if self._points else 0.0


@dataclass(frozen=True)
class Member:
    """One instance of the model, as the autoscaler sees it."""

    instance_id: str
    started_at: float  # when its start was decided (the protect period runs from here)
    requests: int = 0  # requests it holds now
    stoppable: bool = True  # the caller may rule it out of stopping (the live planner: one with requests)


@dataclass(frozen=True)
class ScaleDecision:
    start: int  # instances to start
    stop: tuple[str, ...]  # instances to stop (drain), fewest requests first
    load: float  # the averaged load it acted on
    capacity: int  # B x (instances + starting)


def decide(load: float, instances: Sequence[Member], starting: int, now: float, p: AutoscaleParams) -> ScaleDecision:
    """The rule for one model: `instances` serve it (not stopped), `starting` more are being started."""
    n = len(instances) + starting
    capacity = n * p.batch_size
    if load < capacity * p.scale_down_at:
        excess = n - math.ceil(load / p.scale_down_at / p.batch_size)
        old = [m for m in instances if m.stoppable and now - m.started_at > p.protect_s]
        old.sort(key=lambda m: (m.requests, m.instance_id))
        return ScaleDecision(0, tuple(m.instance_id for m in old[:max(0, excess)]), load, capacity)
    if load > capacity * p.scale_up_at:
        return ScaleDecision(max(0, math.ceil(load / p.scale_up_at / p.batch_size) - n), (), load, capacity)
    return ScaleDecision(0, (), load, capacity)


def direct_start(has_room: bool, starting: int) -> bool:
    """A request arrived: start an instance for it now when none has room and none is being started."""
    return not has_room and starting == 0


__all__ = ["AutoscaleParams", "LoadWindow", "Member", "ScaleDecision", "decide", "direct_start"]
