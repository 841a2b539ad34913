"""Scale from zero: where to start an instance of a model the dispatcher has queued requests for.

A `CapacityRequest` (the dispatcher holds requests for a model no live instance serves) becomes one
`ScaleUp` effect — `LoadModel` on the chosen worker. The choice, on the view alone (pure):
* candidates are usable workers with no accepting instance of the model;
* a worker holding prewarmed bytes of the model comes first, the most warm bytes first (its start
  reads little or nothing from the checkpoint: WarmServe's prewarm hit);
* then the one with the most room, where room = free bytes + every prewarmed byte (warm weights of
  other models are given up for a serving instance) + KV reserved but unused; a worker whose room
  cannot hold the model's weights (less what is warm there) is no candidate.
One scale-up per model is in flight at a time: a second request meanwhile gets the first plan's id.
"""
from __future__ import annotations

import re

from shared.events.plan import PlanOutcome, ScaleUp
from shared.planner.effects import Decision, Effect, action_of
from shared.planner.policy import Busy
from shared.planner.view import ClusterView, WorkerView

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
SCALE_UP_TTL_S = 120.0  # a cold start may read a large checkpoint


def scale_up_instance_id(worker_id: str, model: str, generation: int | None = None) -> str:
    """The instance id a worker gives its instance of `model` (as services/gpu_worker/loading.py does);
    a scale-up adds its start second (`generation`), so a new instance on a worker where an evicted one
    of the model ran has another id: a dispatcher that a draining instance turned away avoids that id."""
    base = f"{worker_id}-{_UNSAFE.sub('_', model)}"
    return base[:64] if generation is None else f"{base[:52]}-{generation}"[:64]


def room_bytes(worker: WorkerView) -> int:
    """Bytes a new instance could get there: free, prewarmed (any model), KV reserved but unused."""
    b = worker.pool_bytes
    return b.get("free", 0) + b.get("prewarm", 0) + max(0, b.get("kv", 0) - worker.kv_used_bytes)


class ScaleUpPolicy:
    name = "scale_up"

    def __init__(self) -> None:
        self.pending: dict[str, str] = {}  # model -> plan id of its scale-up in flight

    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        return []  # decides only on a capacity request (`for_capacity`), never on the interval

    def for_capacity(self, view: ClusterView, model: str) -> Decision | None:
        """A ScaleUp for `model`, or None when no worker can take it (or it is not in the catalog)."""
        record = view.models.get(model)
        if record is None:
            return None
        need = record.weight_bytes
        best: tuple[tuple[int, int, str], WorkerView] | None = None
        for worker in view.usable_workers():
            if any(i.model == model for i in worker.instances):
                continue  # it serves the model already (or is evicting it: it would refuse busy)
            warm = worker.prewarmed.get(model, 0)
            room = room_bytes(worker)
            if room + warm < need:
                continue
            rank = (-warm, -room, worker.worker_id)
            if best is None or rank < best[0]:
                best = (rank, worker)
        if best is None:
            return None
        worker = best[1]
        warm = worker.prewarmed.get(model, 0)
        why = (f"{model} has queued requests and no instance; {worker.worker_id} holds {warm} B of it warm"
               if warm else f"{model} has queued requests and no instance; {worker.worker_id} has the most room")
        return Decision(action=ScaleUp(model=model, worker_id=worker.worker_id,
                                       instance_id=scale_up_instance_id(worker.worker_id, model, int(view.now))),
                        trigger="capacity_request", reason=why, ttl_s=SCALE_UP_TTL_S)

    def started(self, model: str, plan_id: str) -> None:
        self.pending[model] = plan_id

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        action = action_of(effect)
        if isinstance(action, ScaleUp) and self.pending.get(action.model) == effect.plan_id:
            del self.pending[action.model]


__all__ = ["SCALE_UP_TTL_S", "ScaleUpPolicy", "room_bytes", "scale_up_instance_id"]
