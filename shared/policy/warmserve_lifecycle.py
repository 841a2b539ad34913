"""The WarmServe worker lifecycle (§4, Fig. 5) as a pure state machine over frozen values.

    idle --prewarm--> universal --dedicate(m)--> dedicated(m) --begin_grace--> dedicated(m, grace)
      ^                  |  ^                                                     |  prewarm (proactive,
      |-- evict last ----|  |------------------- release -------------------------|  into surplus KV)

- idle: no weights. universal: prewarmed weights of one or more models, no instance.
- dedicated(m): serving an instance of m. `dedicate` evicts every other prewarmed model; it is a
  *hit* when m was prewarmed there (no checkpoint read), a cold start otherwise.
- In its grace period (stopping: no new requests, finishing its own) a dedicated worker may take
  proactive prewarms into its KV surplus (Eq. 1). `release` (the instance is gone) makes it
  universal, holding the served model's weights and the proactive ones (Fig. 5b);
  `cancel_grace` (the load came back) drops the proactive prewarms so the KV can grow again.

Every transition returns the new value and what it evicted; an illegal one raises
`LifecycleError` naming the worker, its state and the transition.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class WorkerRole(StrEnum):
    IDLE = "idle"
    UNIVERSAL = "universal"
    DEDICATED = "dedicated"


class LifecycleError(ValueError):
    pass


@dataclass(frozen=True)
class WorkerLife:
    worker: str
    role: WorkerRole = WorkerRole.IDLE
    serving: str | None = None  # the model of its instance (dedicated only)
    grace: bool = False  # dedicated and stopping
    prewarmed: frozenset[str] = frozenset()  # models whose weights it holds besides `serving`

    def __post_init__(self) -> None:
        dedicated = self.role is WorkerRole.DEDICATED
        if dedicated != (self.serving is not None):
            raise LifecycleError(f"{self.worker}: a worker serves a model exactly when it is dedicated")
        if self.grace and not dedicated:
            raise LifecycleError(f"{self.worker}: only a dedicated worker has a grace period")
        if dedicated and self.prewarmed and not self.grace:
            raise LifecycleError(f"{self.worker}: a dedicated worker holds other weights only in its grace period")
        if self.role is WorkerRole.UNIVERSAL and not self.prewarmed:
            raise LifecycleError(f"{self.worker}: a universal worker holds at least one prewarmed model")
        if self.role is WorkerRole.IDLE and self.prewarmed:
            raise LifecycleError(f"{self.worker}: an idle worker holds no weights")

    @classmethod
    def idle(cls, worker: str) -> "WorkerLife":
        return cls(worker)

    def _refuse(self, what: str, why: str) -> LifecycleError:
        state = self.role.value + (f"({self.serving}{', grace' if self.grace else ''})" if self.serving else "")
        return LifecycleError(f"{self.worker}: cannot {what} while {state}: {why}")

    def prewarm(self, model: str) -> "WorkerLife":
        """Load `model`'s weights: idle/universal become universal; a grace-period worker prewarms proactively."""
        if self.role is WorkerRole.DEDICATED and not self.grace:
            raise self._refuse(f"prewarm {model!r}", "its instance owns the memory (prewarm only in the grace period)")
        if model in self.prewarmed or model == self.serving:
            raise self._refuse(f"prewarm {model!r}", "its weights are already here")
        role = WorkerRole.DEDICATED if self.role is WorkerRole.DEDICATED else WorkerRole.UNIVERSAL
        return replace(self, role=role, prewarmed=self.prewarmed | {model})

    def evict(self, model: str) -> "WorkerLife":
        """Drop a prewarmed model; a universal worker left with none is idle."""
        if model not in self.prewarmed:
            raise self._refuse(f"evict {model!r}", "it is not prewarmed here")
        left = self.prewarmed - {model}
        role = self.role if self.role is WorkerRole.DEDICATED or left else WorkerRole.IDLE
        return replace(self, role=role, prewarmed=left)

    def dedicate(self, model: str) -> tuple["WorkerLife", bool, frozenset[str]]:
        """Start an instance of `model`: (the worker, whether it was a prewarm hit, the models evicted)."""
        if self.role is WorkerRole.DEDICATED:
            raise self._refuse(f"dedicate to {model!r}", "it already serves an instance")
        hit = model in self.prewarmed
        return WorkerLife(self.worker, WorkerRole.DEDICATED, serving=model), hit, self.prewarmed - {model}

    def begin_grace(self) -> "WorkerLife":
        if self.role is not WorkerRole.DEDICATED or self.grace:
            raise self._refuse("begin a grace period", "only a serving, not yet stopping, worker can")
        return replace(self, grace=True)

    def cancel_grace(self) -> tuple["WorkerLife", frozenset[str]]:
        """The instance takes traffic again: proactive prewarms are dropped (the KV needs the room)."""
        if not self.grace:
            raise self._refuse("cancel the grace period", "it is not in one")
        return WorkerLife(self.worker, WorkerRole.DEDICATED, serving=self.serving), self.prewarmed

    def release(self) -> "WorkerLife":
        """The instance is gone: universal, with the served model's weights kept as prewarmed."""
        if self.role is not WorkerRole.DEDICATED:
            raise self._refuse("release", "it serves no instance")
        assert self.serving is not None
        return WorkerLife(self.worker, WorkerRole.UNIVERSAL, prewarmed=self.prewarmed | {self.serving})

    def holds(self, model: str) -> bool:
        return model == self.serving or model in self.prewarmed


__all__ = ["LifecycleError", "WorkerLife", "WorkerRole"]
