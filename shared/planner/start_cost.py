"""Where a start serves first soonest (pure): a warm worker that is busy against a cold one that is idle.

Both scale-up paths (a dispatcher's capacity request, shared/planner/scale_up.py; WarmServe's autoscaler,
shared/planner/warmserve_policy.py) once ranked a worker holding the model warm first, however busy it was.
On workers that serve several models from one pool (the CPU workers here: one engine thread per instance,
one process), a start onto a worker whose other models are busy puts the new instance's requests behind
theirs; in `tidal repro warmserve --live` a warm start next to the other hot model of the phase gave that
phase's slowest TTFTs (4-4.5 s) while two workers idled (docs/warmserve.md "The scale-up target").

So each candidate is scored by the seconds until its instance would serve a request:

    wait = cold_bytes / bytes_per_s + busy_requests x request_s

* cold_bytes: the model's weights less what is warm there (0 for a full warm copy);
* bytes_per_s: measured, the median over the last `SAMPLES` applied starts that read the checkpoint of
  cold bytes / the start's wall time (PlanApplied.duration_s: the LoadModel round trip), the setting
  before any;
* busy_requests: the requests on the worker's serving instances of other models — now (running and
  waiting) or, if more, their model's recent load per instance (the autoscaler's window), which sees a
  model that is hot but happens to hold nothing this instant;
* request_s: a request's mean time in the system ([planner] request_time).

The lowest wait wins; ties (every idle cold worker) fall back to the caller's order. A warm idle worker
still beats a cold one (its start reads less), and a warm busy one is passed over only when its queue
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
    measured: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))  # cold bytes/s of recent starts
    model_load: dict[str, float] = field(default_factory=dict)  # model -> recent load per serving instance

    def __post_init__(self) -> None:
        if not self.default_bytes_per_s > 0 or not self.request_s > 0:
            raise ValueError(f"need default_bytes_per_s > 0 and request_s > 0, got {self.default_bytes_per_s} "
                             f"and {self.request_s}")

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
        """Seconds until an instance of `model` started on `worker` would serve (see the module doc)."""
        cold = max(0, weight_bytes - worker.prewarmed.get(model, 0))
        return cold / self.bytes_per_s + self.busy_requests(worker, model) * self.request_s


__all__ = ["SAMPLES", "StartCosts"]
