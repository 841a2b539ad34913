"""Which queued requests give up waiting: their model has had no live instance for a grace period,
or their own deadline passed while they waited. Pure: the dispatcher ends each with `queue_timeout`."""
from __future__ import annotations

from collections.abc import Callable, Mapping

from services.dispatcher.admission_queue import AdmissionQueues
from services.dispatcher.tracked import TrackedRequest

NO_INSTANCE_GRACE_S = 30.0  # a queued request whose model has no live instance this long fails


class QueueExpiry:
    def __init__(self) -> None:
        self.no_instance_since: dict[str, float] = {}  # per queued model: since when it has no instance

    def expired(self, queues: AdmissionQueues, requests: Mapping[str, TrackedRequest],
                has_instance: Callable[[str], bool], now: float) -> list[tuple[TrackedRequest, str]]:
        """Each queued request that gives up now, with why."""
        queued = set(queues.models())
        for model in [m for m in self.no_instance_since if m not in queued]:
            del self.no_instance_since[model]  # its queue emptied: the next cold spell is timed afresh
        out: list[tuple[TrackedRequest, str]] = []
        for model in queued:
            if has_instance(model):
                self.no_instance_since.pop(model, None)
            else:
                self.no_instance_since.setdefault(model, now)
            orphaned = now - self.no_instance_since.get(model, now) >= NO_INSTANCE_GRACE_S
            for rid in queues.in_order(model):
                req = requests[rid]
                deadline = req.submit.deadline_ts
                if orphaned or (deadline is not None and now >= deadline):
                    out.append((req, f"no instance of {model!r} for {NO_INSTANCE_GRACE_S:.0f}s" if orphaned
                                else "its deadline passed while it waited in the queue"))
        return out
