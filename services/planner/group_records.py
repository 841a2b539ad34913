"""Buddy groups in the registry's `groups` bucket, as the planner applies FormGroup and DissolveGroup.

FormGroup writes the record (`forming`, with the members and the plan id) before any JoinGroup is
sent, so the group is known even if a member refuses midway, and marks it `active` once every
member joined; a worker that writes the record itself on JoinGroup finds it there and leaves it
(compare-and-set). DissolveGroup reads the members from the record (the action names only the
group) and marks it `dissolved` once every member left.
"""
from __future__ import annotations

import time

import msgspec

from shared.bus import Bus
from shared.events.common import GroupMember
from shared.events.plan import FormGroup
from shared.events.registry import Bucket, GroupRecord, GroupState
from shared.registry_client import RegistryClient


async def record_forming(bus: Bus, action: FormGroup, plan_id: str, *, timeout_s: float) -> None:
    """Write the group's record unless it exists (a retried effect, or a worker was first)."""
    record = GroupRecord(group_id=action.group_id, model=action.model, members=action.members, state="forming",
                         plan_id=plan_id, created_ts=time.time())
    await RegistryClient(bus, timeout=timeout_s).modify(Bucket.GROUPS, action.group_id,
                                                        lambda current: None if current is not None else record)


async def members_of(bus: Bus, group_id: str, *, timeout_s: float) -> list[GroupMember]:
    """The members of `group_id` from its record; ValueError when the registry has none."""
    entry = await RegistryClient(bus, timeout=timeout_s).get(Bucket.GROUPS, group_id)
    if entry is None or not isinstance(entry.record, GroupRecord):
        raise ValueError(f"group {group_id} has no record in the registry's groups bucket: its members are unknown")
    return list(entry.record.members)


async def set_state(bus: Bus, group_id: str, state: GroupState, *, timeout_s: float) -> None:
    def change(current: GroupRecord | None) -> GroupRecord | None:
        if current is None or current.state == state:
            return None
        return msgspec.structs.replace(current, state=state)

    await RegistryClient(bus, timeout=timeout_s).modify(Bucket.GROUPS, group_id, change)


__all__ = ["members_of", "record_forming", "set_state"]
