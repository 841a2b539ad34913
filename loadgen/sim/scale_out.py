"""Scale-out in `tidal sim`: the default config's floor of one instance and its saturation rule.

The live default cluster (shared/default_cluster.toml) keeps `min_instances` instances of a model
however idle; its other workers stand by, empty. The planner, every `[planner] interval`, feeds
each model's serving instances (running, waiting, generated tokens/s) and the dispatchers' queue
to `shared.policy.saturation.SaturationMonitor` — the same pure code, here — and when it names a
saturation and no start is in flight, one more instance starts on a standby worker. That worker
serves from `start_s` later: the measured instance start (`CostProfile.instance_start_s`, which
`tidal profile` times: the checkpoint read and the engine built), plus up to one stats interval
before the dispatcher sees it. Requests already on an instance stay there, as live. The trace starts
on a cluster that has been idle with its floor of instances (as `make run` is once the keep-alive
stopped the others): the monitor has watched them for a window already, so a queue at the start
counts at once, as it does live.

Without a `ScaleOut` the simulator keeps every worker serving from time 0 (its old behaviour).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.policy.saturation import InstanceLoad, SaturationMonitor, SaturationParams


@dataclass(frozen=True)
class ScaleOutSpec:
    initial: int = 1  # instances per model serving at time 0 ([planner] min_instances)
    interval_s: float = 1.0  # [planner] interval: how often the monitor samples
    start_s: float = 5.0  # decision -> serving: the measured instance start
    stats_lag_s: float = 1.0  # [dispatcher] stats_interval: until the dispatcher routes to it
    saturation: SaturationParams = field(default_factory=SaturationParams)

    def __post_init__(self) -> None:
        if self.initial < 1 or self.interval_s <= 0 or self.start_s < 0 or self.stats_lag_s < 0:
            raise ValueError(f"scale-out: need initial >= 1, interval_s > 0, start_s >= 0, stats_lag_s >= 0 "
                             f"(got {self.initial}, {self.interval_s}, {self.start_s}, {self.stats_lag_s})")


@dataclass
class ScaleEvent:
    decided_s: float
    serving_s: float
    worker: str
    model: str
    reason: str


def instance_load(w) -> InstanceLoad:  # type: ignore[no-untyped-def]
    """A simulated worker as its stats report it: running, waiting, and the tokens/s of its current
    step (one token per decoding sequence per step: what a live stats interval counts)."""
    running = w.decoding + len(w.prefilling)
    rate = w.decoding / w.run_base if w.busy and w.decoding and w.run_base > 0 else 0.0
    return InstanceLoad(running=running, waiting=len(w.waiting), tokens_per_s=rate)


class ScaleOut:
    """Driven by `Simulator.run`: `next_s` is when it wants the clock next; `tick(sim, t)` then."""

    def __init__(self, spec: ScaleOutSpec) -> None:
        self.spec = spec
        self.monitor = SaturationMonitor(spec.saturation)
        self.next_tick = 0.0
        self.pending: list[tuple[float, object]] = []  # (serving at, worker)
        self.events: list[ScaleEvent] = []

    def standby(self, workers: list) -> set[int]:  # type: ignore[type-arg]
        """Indices of the workers that start empty: all but the first `initial` of each model."""
        seen: dict[str, int] = {}
        out = set()
        for w in workers:
            seen[w.model] = seen.get(w.model, 0) + 1
            if seen[w.model] > self.spec.initial:
                out.add(w.index)
        return out

    @property
    def next_s(self) -> float:
        return min([self.next_tick] + [t for t, _ in self.pending])

    def tick(self, sim, t: float) -> None:  # type: ignore[no-untyped-def]
        due = [(s, w) for s, w in self.pending if s <= t]
        for item in due:
            self.pending.remove(item)
            sim.activate(item[1])
        if t < self.next_tick:
            return
        first, self.next_tick = self.next_tick == 0.0 and not self.events, t + self.spec.interval_s
        for model in sorted({w.model for w in sim.workers}):
            serving = [w for w in sim.workers if w.model == model and w.index not in sim.standby]
            if first and model not in self.monitor.models:
                # the trace starts on a cluster that has served nothing for a while with these instances
                # (live: the planner has watched them since the last change): no settling window at 0
                idle = [InstanceLoad(running=0, waiting=0, tokens_per_s=0.0)] * len(serving)
                self.monitor.observe(model, t - self.spec.saturation.window_s, idle, 0)
            self.monitor.observe(model, t, [instance_load(w) for w in serving], 0)
            why = self.monitor.verdict(model, t)
            starting = any(w.model == model for _, w in self.pending)
            spare = [w for w in sim.workers if w.model == model and w.index in sim.standby
                     and all(w is not p for _, p in self.pending)]
            if why is None or starting or not spare:
                continue
            ready = t + self.spec.start_s + self.spec.stats_lag_s
            self.pending.append((ready, spare[0]))
            self.events.append(ScaleEvent(t, ready, spare[0].worker_id, model, why))




def spec_from_config(config, start_s: float) -> ScaleOutSpec:  # type: ignore[no-untyped-def]
    """The scale-out a cluster config runs live (services/planner/policies.py builds the same params):
    its floor, planner interval, stats interval and [slo] tpot; `start_s` from the profile."""
    p = config.planner
    if not (p.enabled and p.autoscale and p.scale_on_saturation):
        raise ValueError("the config does not scale out on saturation ([planner] enabled, autoscale and "
                         "scale_on_saturation must be true)")
    tpot = config.slo.tpot
    return ScaleOutSpec(initial=max(1, p.min_instances), interval_s=float(p.interval), start_s=start_s,
                        stats_lag_s=float(config.dispatcher.stats_interval),
                        saturation=SaturationParams(tpot_s=tpot.absolute_s, tpot_factor=tpot.factor))


__all__ = ["ScaleEvent", "ScaleOut", "ScaleOutSpec", "instance_load", "spec_from_config"]
