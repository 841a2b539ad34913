"""The Policy protocol: one mechanism (one paper) the planner core runs every interval.

    class MyPolicy:
        name = "mine"
        def decide(self, view: ClusterView, busy: Busy) -> list[Decision]: ...
        def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None: ...   # optional feedback
        def placement_hints(self, view: ClusterView) -> list[PlacementHints]: ...  # optional: routing of new requests
        def follow_ups(self, view: ClusterView, busy: Busy) -> list[Decision]: ...  # optional: right after an outcome

`decide` gets the current view and the keys of effects still in flight (`busy.has(key)`); it
returns new decisions and may keep state between calls (e.g. MELL's placement). The core drops a
decision whose key is busy, gives the rest effect ids and tracks them until their outcome comes
back through `on_outcome` (applied, failed or cancelled, including expiry and staleness). A policy
that decides where new requests should go gives `placement_hints` (PlannerCore.placement_hints
gathers them; the planner service publishes them for the dispatcher's routing).

Policies: `kunserve_policy.KunServePolicy` (KunServe: buddy groups; its group steps come as
`follow_ups`, each as soon as the previous one's outcome is back) and `mell_policy.MellPolicy` (MELL:
consolidation and KV pressure by migration); CaraServe and WarmServe plug in the same way. Their
order is services/planner/policies.py's (the memory economy: cheapest source first).
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

from shared.events.plan import PlacementHints, PlanOutcome
from shared.planner.effects import Decision, Effect, EffectKey
from shared.planner.view import ClusterView


class Busy:
    """Read-only: what the core has in flight, by effect key and by request."""

    def __init__(self, keys: Collection[EffectKey]) -> None:
        self._keys = frozenset(keys)

    def has(self, key: EffectKey) -> bool:
        return key in self._keys

    def request(self, request_id: str) -> bool:
        return ("request", request_id) in self._keys

    def __len__(self) -> int:
        return len(self._keys)


@runtime_checkable
class Policy(Protocol):
    name: str

    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]: ...


def notify(policy: Policy, effect: Effect, outcome: PlanOutcome) -> None:
    """Tell a policy how one of its effects ended, if it wants to know."""
    hook = getattr(policy, "on_outcome", None)
    if hook is not None:
        hook(effect, outcome)


def hints_of(policy: Policy, view: ClusterView) -> list[PlacementHints]:
    """A policy's placement hints for new requests, if it gives any."""
    hook = getattr(policy, "placement_hints", None)
    return [] if hook is None else list(hook(view))


__all__ = ["Busy", "Policy", "hints_of", "notify"]
