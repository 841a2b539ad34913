"""Before a JoinGroup: is every other member a live instance of the same model where it says?

A member that does not exist (an unknown worker, or a real worker without that instance) would
never run its stage: requests routed through it would wait forever. The registry knows every
worker (`workers`, with its liveness and incarnation) and instance (`instances`); a member it
does not know, one of another model, or one on a dead worker is refused before anything joins.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.events.common import GroupMember
from shared.events.registry import Bucket, InstanceRecord, WorkerRecord
from shared.events.worker import WorkerState
from shared.registry_client import RegistryClient
from shared.wire import TidalError


@dataclass
class MemberCheck:
    problem: str | None = None  # why the join is refused (None: every member checks out)
    unreachable: bool = False  # the registry did not answer
    incarnations: dict[str, str] = field(default_factory=dict)  # worker -> its incarnation (registry)


async def check_members(registry: RegistryClient, members: list[GroupMember], *, me: str, model: str,
                        local: Callable[[str], str | None]) -> MemberCheck:
    """`me`: this worker; `local(instance_id)`: the model of an instance here (None: none).
    Members on this worker are checked locally, the others in the registry."""
    out = MemberCheck()
    for m in members:
        if m.worker_id == me:
            here = local(m.instance_id)
            if here != model:
                out.problem = (f"member {m.instance_id}: no instance of {model} by that id on {me}" if here is None
                               else f"member {m.instance_id} on {me} serves {here}, not {model}")
                return out
            continue
        try:
            worker = await registry.get(Bucket.WORKERS, m.worker_id)
            instance = await registry.get(Bucket.INSTANCES, m.instance_id)
        except (TidalError, OSError) as exc:
            out.problem, out.unreachable = f"the registry could not be asked about member {m.instance_id}: {exc}", True
            return out
        if worker is None or not isinstance(worker.record, WorkerRecord):
            out.problem = f"member {m.instance_id}: no worker {m.worker_id} in the registry"
            return out
        if worker.record.state == WorkerState.DEAD:
            out.problem = f"member {m.instance_id}: worker {m.worker_id} is dead"
            return out
        rec = instance.record if instance is not None else None
        if not isinstance(rec, InstanceRecord) or rec.worker_id != m.worker_id or rec.state in ("stopped",):
            out.problem = f"member {m.instance_id}: worker {m.worker_id} has no such instance in the registry"
            return out
        if rec.model != model:
            out.problem = f"member {m.instance_id} on {m.worker_id} serves {rec.model}, not {model}"
            return out
        if worker.record.incarnation:
            out.incarnations[m.worker_id] = worker.record.incarnation
    return out


__all__ = ["MemberCheck", "check_members"]
