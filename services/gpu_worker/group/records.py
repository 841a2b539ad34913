"""A buddy group's record in the registry's `groups` bucket, as its members write it (best effort)."""
from __future__ import annotations

from collections.abc import Callable

from shared.bus import Bus
from shared.events.registry import Bucket, GroupRecord
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.wire import TidalError

log = get_logger("tidal.gpu_worker.group_ctl")
Change = Callable[[GroupRecord | None], GroupRecord | None]  # the new record, or None: leave it


async def write_record(bus: Bus, group_id: str, change: Change) -> None:
    """Compare-and-set `change` on the record; a registry away is logged (the member runs on, and
    the planner's view catches up)."""
    try:
        await RegistryClient(bus, timeout=2.0).modify(Bucket.GROUPS, group_id, change)  # type: ignore[arg-type]
    except (TidalError, OSError) as exc:
        log.warning("group record not written", group=group_id, error=repr(exc))


def with_state(r: GroupRecord | None, state: str) -> GroupRecord | None:
    if r is None:
        return None
    return GroupRecord(group_id=r.group_id, model=r.model, members=r.members, state=state,  # type: ignore[arg-type]
                       plan_id=r.plan_id, created_ts=r.created_ts)


__all__ = ["write_record", "with_state"]
