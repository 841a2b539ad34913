"""PlannerCore: a pure state machine — views in, effects out, outcomes back in.

    core = PlannerCore([MellPolicy(...)], id_prefix="p1")
    effects = core.step(view)             # new effects (publish PlanDecided, then apply them)
    core.dispatched(effect.plan_id, view) # before applying: None, or why it is stale now (it was cancelled)
    core.on_outcome(PlanApplied(...))     # or PlanFailed / PlanCancelled, when the effect ended
    closed = core.take_closed()           # PlanFailed / PlanCancelled the core itself produced (publish them)
    hints = core.placement_hints(view)    # after step: where new requests should go (PlacementHints per model)
    more = core.follow_up(view)           # after an outcome: a sequence's next step (policies' `follow_ups`)

Every effect ends exactly once: by an outcome, by expiring (no outcome `ttl` after it was decided:
PlanFailed), or, while not yet dispatched, by going stale (a worker it needs died, its request finished
or is already elsewhere: PlanCancelled). An outcome for an effect that already ended is ignored
(`on_outcome` returns None), so a late reply never closes it twice. A disabled core decides nothing
but still closes what it has in flight. No I/O, no clock: time is `view.now`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from shared.events.plan import (
    Migrate, PlacementHints, PlanApplied, PlanCancelled, PlanFailed, PlanOutcome, ReportIdle,
)
from shared.planner.effects import Decision, Effect, EffectKey, action_of, key, make_effect, workers_of
from shared.planner.policy import Busy, Policy, hints_of, notify
from shared.planner.view import ClusterView

DEFAULT_TTL_S = 60.0


@dataclass(slots=True)
class InFlight:
    effect: Effect
    policy: Policy
    expires_at: float
    dispatched: bool = False


class PlannerCore:
    def __init__(self, policies: Sequence[Policy], *, enabled: bool = True, default_ttl_s: float = DEFAULT_TTL_S,
                 id_prefix: str = "e") -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self.policies = list(policies)
        self.enabled = enabled
        self.default_ttl_s = default_ttl_s
        self.id_prefix = id_prefix
        self.inflight: dict[str, InFlight] = {}
        self._by_key: dict[EffectKey, str] = {}
        self._closed: list[PlanFailed | PlanCancelled] = []
        self._next = 0
        self.counts: Counter[str] = Counter()  # decided, applied, failed, cancelled, expired, suppressed, late

    # --- deciding ---------------------------------------------------------------------
    def step(self, view: ClusterView) -> list[Effect]:
        """Close expired and stale effects, then ask every policy; returns the new effects."""
        self._expire(view)
        if not self.enabled:
            return []
        new: list[Effect] = []
        for policy in self.policies:
            new += self.submit(policy, policy.decide(view, Busy(self._by_key)), view)
        return new

    def submit(self, policy: Policy, decisions: Sequence[Decision], view: ClusterView) -> list[Effect]:
        """Track `policy`'s decisions as effects (step's own, or ones made between intervals, e.g. on a
        capacity request); a decision whose key is in flight is dropped. Returns the new effects."""
        new: list[Effect] = []
        for decision in decisions:
            k = key(decision.action)
            if k in self._by_key:
                self.counts["suppressed"] += 1  # already in flight: never decided twice
                continue
            effect = make_effect(self._new_id(), decision, view.now)
            ttl = decision.ttl_s if decision.ttl_s is not None else self.default_ttl_s
            self.inflight[effect.plan_id] = InFlight(effect, policy, view.now + ttl)
            self._by_key[k] = effect.plan_id
            self.counts["decided"] += 1
            new.append(effect)
        return new

    def placement_hints(self, view: ClusterView) -> list[PlacementHints]:
        """Placement for new requests from every policy that gives it (optional `placement_hints(view)`),
        for the dispatcher and the simulator's routing; none while disabled (nothing decides)."""
        if not self.enabled:
            return []
        return [h for policy in self.policies for h in hints_of(policy, view)]

    def follow_up(self, view: ClusterView) -> list[Effect]:
        """Decisions made as soon as an outcome came back, not at the next interval: the next step of a
        sequence that must wait for the previous one (KunServe: JoinGroup on every member before any
        DropLayers). Asks each policy's optional `follow_ups(view, busy)`; returns the new effects."""
        if not self.enabled:
            return []
        new: list[Effect] = []
        for policy in self.policies:
            hook = getattr(policy, "follow_ups", None)
            if hook is not None:
                new += self.submit(policy, hook(view, Busy(self._by_key)), view)
        return new

    def _new_id(self) -> str:
        self._next += 1
        return f"{self.id_prefix}-{self._next}"

    def _expire(self, view: ClusterView) -> None:
        for effect_id, entry in list(self.inflight.items()):
            if view.now >= entry.expires_at:
                self.counts["expired"] += 1
                self._close(PlanFailed(plan_id=effect_id, ts=view.now, action_index=0,
                                       message="expired: no outcome came back in time"), produced=True)
                continue
            if not entry.dispatched:
                why = stale_reason(entry.effect, view)
                if why is not None:
                    self._close(PlanCancelled(plan_id=effect_id, ts=view.now, message=f"stale: {why}"), produced=True)

    # --- applying ---------------------------------------------------------------------
    def dispatched(self, effect_id: str, view: ClusterView | None = None) -> str | None:
        """The effect is about to be applied. Returns None (go ahead), or why not: it already ended,
        or it is stale in `view` (then it is cancelled here and the PlanCancelled is in take_closed())."""
        entry = self.inflight.get(effect_id)
        if entry is None:
            return f"effect {effect_id} is not in flight"
        if view is not None:
            why = stale_reason(entry.effect, view)
            if why is not None:
                self._close(PlanCancelled(plan_id=effect_id, ts=view.now, message=f"stale: {why}"), produced=True)
                return why
        entry.dispatched = True
        return None

    def on_outcome(self, outcome: PlanOutcome) -> Effect | None:
        """An effect ended; returns it, or None when it had already ended (late or duplicate outcome)."""
        if outcome.plan_id not in self.inflight:
            self.counts["late"] += 1
            return None
        return self._close(outcome, produced=False)

    def _close(self, outcome: PlanOutcome, *, produced: bool) -> Effect:
        entry = self.inflight.pop(outcome.plan_id)
        self._by_key.pop(key(action_of(entry.effect)), None)
        label = {PlanApplied: "applied", PlanFailed: "failed", PlanCancelled: "cancelled"}[type(outcome)]
        self.counts[label] += 1
        if produced:
            self._closed.append(outcome)  # type: ignore[arg-type]
        notify(entry.policy, entry.effect, outcome)
        return entry.effect

    def take_closed(self) -> list[PlanFailed | PlanCancelled]:
        """The outcomes the core produced itself (expiry, staleness) since the last call."""
        closed, self._closed = self._closed, []
        return closed

    def cancel_all(self, now: float, why: str) -> list[PlanCancelled]:
        """Drop every effect not yet dispatched (e.g. the lease was lost); returns their cancellations."""
        out = []
        for effect_id, entry in list(self.inflight.items()):
            if not entry.dispatched:
                event = PlanCancelled(plan_id=effect_id, ts=now, message=why[:2000])
                self._close(event, produced=False)
                out.append(event)
        return out

    def effect(self, effect_id: str) -> Effect | None:
        entry = self.inflight.get(effect_id)
        return entry.effect if entry is not None else None


def stale_reason(effect: Effect, view: ClusterView) -> str | None:
    """Why an effect no longer makes sense in `view`, or None."""
    action = action_of(effect)
    for worker_id in workers_of(action):
        if not view.alive(worker_id):
            return f"worker {worker_id} is dead or unknown"
    if isinstance(action, Migrate):
        where = view.location(action.request_id)
        if where is None:
            return f"request {action.request_id} is no longer running"
        if where[0] != action.source:
            return f"request {action.request_id} is already on {where[0]}"
    if isinstance(action, ReportIdle) and view.workers[action.worker_id].requests:
        return f"worker {action.worker_id} has requests again"
    return None


__all__ = ["DEFAULT_TTL_S", "InFlight", "PlannerCore", "stale_reason"]
