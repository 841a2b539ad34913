"""Scale from zero: where to start an instance of a model the dispatcher has queued requests for.

A `CapacityRequest` (the dispatcher holds requests for a model no live instance serves) becomes one
`ScaleUp` effect — `LoadModel` on the chosen worker. The choice, on the view alone (pure):
* candidates are usable workers with no accepting instance of the model;
* the one where the start costs least comes first (shared/planner/start_cost.py: the cold part of its
  start at the measured load rate, plus the requests of its other models, which the new instance's
  first request waits behind and which share their worker with it until the autoscaler can act): a
  worker holding the model warm wins among idle ones (its start reads little or nothing from the
  checkpoint: WarmServe's prewarm hit), but not when sharing it costs more than the cold start it saves;
* then the most warm bytes, then the one with the most room, where room = free bytes + every prewarmed
  byte (warm weights of other models are given up for a serving instance) + KV reserved but unused; a
  worker whose room cannot hold the model's weights (less what is warm there) is no candidate.
One scale-up per model is in flight at a time: a second request meanwhile gets the first plan's id.

`StartTracker` holds every start decided (this path's and WarmServe's autoscaler's) until the view
shows its instance: a LoadModel is answered when the instance serves, but the worker's stats that list
it may come a moment later, and meanwhile neither path may count the model short of that instance or
send the same worker a second LoadModel for the model (one decision, one LoadModel).
"""
from __future__ import annotations

import re

from dataclasses import dataclass

from shared.events.plan import PlanApplied, PlanOutcome, ScaleUp
from shared.planner.effects import Decision, Effect, action_of
from shared.planner.policy import Busy
from shared.planner.start_cost import StartCosts
from shared.planner.view import ClusterView, WorkerView

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
SCALE_UP_TTL_S = 120.0  # a cold start may read a large checkpoint


def scale_up_instance_id(worker_id: str, model: str, generation: int | None = None) -> str:
    """The instance id a worker gives its instance of `model` (as services/gpu_worker/loading.py does);
    a scale-up adds its start second (`generation`), so a new instance on a worker where an evicted one
    of the model ran has another id: a dispatcher that a draining instance turned away avoids that id."""
    base = f"{worker_id}-{_UNSAFE.sub('_', model)}"
    return base[:64] if generation is None else f"{base[:52]}-{generation}"[:64]


@dataclass
class _Start:
    model: str
    worker_id: str
    plan_id: str
    decided_at: float
    applied_at: float | None = None
    cold_bytes: int = 0  # what it reads from the checkpoint (its weights less what was warm there)


class StartTracker:
    """Starts decided and not yet visible as an instance in the view (pure: time is the view's)."""

    def __init__(self, seen_timeout_s: float = 30.0, costs: StartCosts | None = None) -> None:
        self.seen_timeout_s = seen_timeout_s  # an applied start whose instance never shows up is dropped then
        self._starts: dict[str, _Start] = {}  # instance id -> its start
        self.costs = costs or StartCosts()  # the measured cold-start rate both paths rank workers by

    def add(self, action: ScaleUp, plan_id: str, now: float, cold_bytes: int = 0) -> None:
        self._starts[action.instance_id] = _Start(action.model, action.worker_id, plan_id, now, cold_bytes=cold_bytes)

    def named(self, effect: Effect) -> None:
        """The core gave a decided start its effect id (the plan a capacity request is answered with)."""
        action = action_of(effect)
        start = self._starts.get(action.instance_id) if isinstance(action, ScaleUp) else None
        if start is not None:
            start.plan_id = effect.plan_id

    def ended(self, action: ScaleUp, outcome: PlanOutcome) -> None:
        """Its effect ended: applied (kept until the view shows the instance), else forgotten."""
        start = self._starts.get(action.instance_id)
        if start is None:
            return
        if isinstance(outcome, PlanApplied):
            start.applied_at = outcome.ts
            self.costs.observe(start.cold_bytes, outcome.duration_s)
        else:
            del self._starts[action.instance_id]

    def refresh(self, view: ClusterView) -> None:
        """Forget the starts whose instance the view shows, and applied ones it never showed in time."""
        shown = {i.instance_id for w in view.workers.values() for i in w.instances}
        for iid, start in list(self._starts.items()):
            worker = view.workers.get(start.worker_id)
            there = worker is not None and start.applied_at is not None and worker.stats_ts >= start.applied_at \
                and any(i.model == start.model for i in worker.instances)
            late = start.applied_at is not None and view.now - start.applied_at > self.seen_timeout_s
            if iid in shown or there or late or view.now - start.decided_at > SCALE_UP_TTL_S + self.seen_timeout_s:
                del self._starts[iid]

    def count(self, model: str) -> int:
        return sum(1 for s in self._starts.values() if s.model == model)

    def workers(self, model: str) -> set[str]:
        return {s.worker_id for s in self._starts.values() if s.model == model}

    def plan_of(self, model: str) -> str | None:
        """The plan id of a start of `model` in flight (the oldest), if any."""
        starts = [s for s in self._starts.values() if s.model == model and s.plan_id]
        return min(starts, key=lambda s: s.decided_at).plan_id if starts else None


def room_bytes(worker: WorkerView) -> int:
    """Bytes a new instance could get there: free, prewarmed (any model), KV reserved but unused."""
    b = worker.pool_bytes
    return b.get("free", 0) + b.get("prewarm", 0) + max(0, b.get("kv", 0) - worker.kv_used_bytes)


class ScaleUpPolicy:
    name = "scale_up"

    def __init__(self, tracker: StartTracker | None = None) -> None:
        self.pending: dict[str, str] = {}  # model -> plan id of its scale-up in flight
        self.tracker = tracker or StartTracker()  # every start in flight, both paths
        self._cold: dict[str, int] = {}  # instance id -> cold bytes of a start decided, until `started`

    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        return []  # decides only on a capacity request (`for_capacity`), never on the interval

    def for_capacity(self, view: ClusterView, model: str) -> Decision | None:
        """A ScaleUp for `model`, or None when no worker can take it (or it is not in the catalog)."""
        record = view.models.get(model)
        if record is None:
            return None
        need = record.weight_bytes
        self.tracker.refresh(view)
        starting = self.tracker.workers(model)
        best: tuple[tuple[float, int, int, str], WorkerView] | None = None
        for worker in view.usable_workers():
            if any(i.model == model for i in worker.instances) or worker.worker_id in starting:
                continue  # it serves the model already (or is evicting or starting it: it would refuse busy)
            warm = worker.prewarmed.get(model, 0)
            room = room_bytes(worker)
            if room + warm < need:
                continue
            rank = (self.tracker.costs.wait_s(worker, model, need), -warm, -room, worker.worker_id)
            if best is None or rank < best[0]:
                best = (rank, worker)
        if best is None:
            return None
        worker = best[1]
        warm = worker.prewarmed.get(model, 0)
        why = (f"{model} has queued requests and no instance; {worker.worker_id} holds {warm} B of it warm"
               if warm else f"{model} has queued requests and no instance; {worker.worker_id} has the most room")
        action = ScaleUp(model=model, worker_id=worker.worker_id,
                         instance_id=scale_up_instance_id(worker.worker_id, model, int(view.now)))
        self._cold[action.instance_id] = max(0, need - warm)
        return Decision(action=action, trigger="capacity_request", ttl_s=SCALE_UP_TTL_S,
                        reason=f"{why} (start cost ~{best[0][0]:.1f} s)")

    def started(self, effect: Effect) -> None:
        action = action_of(effect)
        assert isinstance(action, ScaleUp)
        self.pending[action.model] = effect.plan_id
        self.tracker.add(action, effect.plan_id, effect.ts, self._cold.pop(action.instance_id, 0))

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        action = action_of(effect)
        if isinstance(action, ScaleUp):
            self.tracker.ended(action, outcome)
            if self.pending.get(action.model) == effect.plan_id:
                del self.pending[action.model]


__all__ = ["SCALE_UP_TTL_S", "ScaleUpPolicy", "StartTracker", "room_bytes", "scale_up_instance_id"]
