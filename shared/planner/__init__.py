"""The planner's pure core: ClusterView in, effects out, outcomes back in (docs/planner.md).

No I/O, no clock reads, no asyncio, nothing from services/: the live planner service
(services/planner) and the simulator (loadgen/sim) drive the same code.
"""
from shared.planner.core import PlannerCore, stale_reason
from shared.planner.effects import Decision, Effect, ctl_commands, effect_kind, key, make_effect
from shared.planner.policy import Busy, Policy
from shared.planner.view import ClusterView, InstanceView, RequestView, WorkerView, build_view, worker_view

__all__ = [
    "Busy", "ClusterView", "Decision", "Effect", "InstanceView", "PlannerCore", "Policy", "RequestView", "WorkerView",
    "build_view", "ctl_commands", "effect_kind", "key", "make_effect", "stale_reason", "worker_view",
]
