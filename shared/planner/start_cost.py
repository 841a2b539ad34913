"""Where a start serves first soonest (pure): a warm worker that is busy against a cold one that is idle.

Both scale-up paths (a dispatcher's capacity request, shared/planner/scale_up.py; WarmServe's autoscaler,
shared/planner/warmserve_policy.py) once ranked a worker holding the model warm first, however busy it was.
On workers that serve several models from one pool (the CPU workers here: one engine thread per instance,
one process), a start onto a worker whose other models are busy puts the new instance's requests behind
theirs; in `tidal repro warmserve --live` a warm start next to the other hot model of the phase gave that
phase's slowest TTFTs (4-4.5 s) while two workers idled (docs/warmserve.md "The scale-up target").

So each candidate is scored by what the start costs in request-seconds of waiting:

    cost = cold_bytes / bytes_per_s + busy_requests x (request_s + horizon_s)

* cold_bytes: the model's weights less what is warm there (0 for a full warm copy);
* bytes_per_s: measured, the median over the last `SAMPLES` applied starts that read the checkpoint of
  cold bytes / the start's wall time (PlanApplied.duration_s: the LoadModel round trip), the setting
  before any;
* busy_requests: the requests on the worker's serving instances of other models — now (running and
  waiting) or, if more, their model's recent load per instance (the autoscaler's window), which sees a
  model that is hot but happens to hold nothing this instant;
* request_s: a request's mean time in the system ([planner] request_time): the new instance's first
  request waits behind the busy ones;
* horizon_s: the autoscaler's window (5 s): sharing the worker costs its incumbents too, for at least as
  long as the autoscaler takes to see their load and move it — each busy request shares the worker with
  the new model's for that long. Without this term the score counted the queue once, and a warm start
  next to the phase's other hot model (scored 0.7-1.3 s against a 2-4 s cold start) slowed both models
  for the whole phase (measured: docs/benchmarks.md "warmserve live").

The lowest cost wins; ties (every idle cold worker) fall back to the caller's order. A warm idle worker
still beats a cold one (its start reads less), and a warm busy one is passed over only when sharing it
costs more than the cold start it saves.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.planner.view import WorkerView

SAMPLES = 16


@dataclass
class StartCosts:
    default_bytes_per_s: float = 2e9  # before any measured cold start (WarmServeSettings.load_bytes_per_s)
    request_s: float = 2.0  # a request's mean time in the system ([planner] request_time)
    horizon_s: float = 5.0  # how long a co-location lasts before the autoscaler can act (its window)
    measured: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))  # cold bytes/s of recent starts
    model_load: dict[str, float] = field(default_factory=dict)  # model -> recent load per serving instance

    def __post_init__(self) -> None:
        if not self.default_bytes_per_s > 0 or not self.request_s > 0 or self.horizon_s < 0:
            raise ValueError(f"need default_bytes_per_s > 0, request_s > 0 and horizon_s >= 0, got "
                             f"{self.default_bytes_per_s}, {self.request_s} and {self.horizon_s}")

    def observe(self, cold_bytes: int, seconds: float) -> None:
        """An applied start that read `cold_bytes` from the checkpoint took `seconds` (its LoadModel)."""
        if cold_bytes > 0 and seconds > 0:
            self.measured.append(cold_bytes / seconds)

    @property
    def bytes_per_s(self) -> float:
        return statistics.median(self.measured) if self.measured else self.default_bytes_per_s

    def busy_requests(self, worker: WorkerView, model: str, recent: Mapping[str, float] | None = None) -> float:
        """Requests the new instance of `model` would queue behind on `worker` (its other models')."""
        recent = self.model_load if recent is None else recent
        return sum(max(float(i.running + i.waiting), recent.get(i.model, 0.0))
                   for i in worker.instances if i.accepting and i.model != model)

    def wait_s(self, worker: WorkerView, model: str, weight_bytes: int) -> float:
        """What starting `model` on `worker` costs, in request-seconds of waiting (see the module doc)."""
        cold = max(0, weight_bytes - worker.prewarmed.get(model, 0))
        return cold / self.bytes_per_s + self.busy_requests(worker, model) * (self.request_s + self.horizon_s)


__all__ = ["SAMPLES", "StartCosts"]
