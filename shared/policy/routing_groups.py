"""Dispatching to KunServe buddy groups (§4.2, §4.3): a group is one routable unit.

After a drop, the members of a buddy group run as one pipeline: a new request is admitted by the
group's entry stage (the member keeping layer 0; §4.2 "forward incoming requests to the instance
with the first half of the layers") and its KV spreads over the members' stages. So the router sees
a group as one instance (`collapse_groups`):

* the entry's ids: the assignment goes to the entry member;
* the group's pooled KV: the members' blocks summed (blocks are per layer, so a token's KV is spread
  over the stages as it was over one instance's layers), used and queued likewise;
* its load: the members' running and waiting requests summed (each member still owns the requests it
  had before the drop, and runs them through the pipeline);
* its batch limit: §4.3's `group_max_batch(k)` for k stages (the k instances' compute at the
  pipeline's efficiency), not k unsplit limits.

Overflow rebalancing (§4.3) follows from the limit: members that held more requests than their group
may now batch make the group's load reach its limit, so the admission gate (`admission.has_room`)
sends new requests, and the ones queued in the dispatcher while the members were full, to spare
instances or other groups instead; the queued ones go to the group as soon as its stats show it
(the dispatcher drains its queues on every worker's stats).

A group is routable only when its members seen cover its layers from 0 without a gap (a lost entry
or middle stage: the pipeline cannot run, the group takes nothing). Pure: no I/O, no clock.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from shared.policy.routing import InstanceView

GroupBatch = Callable[[int, int], int]  # (stages, one member's unsplit max batch) -> the group's batch limit


def summed_batch(stages: int, unsplit_max_batch: int) -> int:
    """The batch limit with no pipeline cost model: k members' limits (an upper bound)."""
    return stages * unsplit_max_batch


def profiled_batch(profile: object) -> GroupBatch:
    """§4.3's limit from a KunServe pipeline profile (`shared.policy.kunserve_profile.PipelineProfile`)."""
    from shared.policy.kunserve_groups import group_max_batch  # the profile's module: loaded on use

    def limit(stages: int, unsplit_max_batch: int) -> int:
        if stages > profile.max_stages:  # type: ignore[attr-defined]
            return summed_batch(stages, unsplit_max_batch)  # deeper than profiled: no cost model to apply
        return group_max_batch(stages, unsplit_max_batch, profile)  # type: ignore[arg-type]

    return limit


def collapse_groups(instances: Sequence[InstanceView], group_batch: GroupBatch = summed_batch) -> list[InstanceView]:
    """The routable units: instances in no group as they are, each complete group as one pooled view
    (in the place of its entry). Members of an incomplete group are left out."""
    groups: dict[str, list[InstanceView]] = {}
    out: list[InstanceView | str] = []
    for inst in instances:
        if inst.group_id is None:
            out.append(inst)
            continue
        if inst.group_id not in groups:
            groups[inst.group_id] = []
            out.append(inst.group_id)  # the group's place in the list
        groups[inst.group_id].append(inst)
    pooled = {gid: pool(members, group_batch) for gid, members in groups.items()}
    return [x if isinstance(x, InstanceView) else pooled[x] for x in out
            if isinstance(x, InstanceView) or pooled[x] is not None]  # type: ignore[misc]


def stages(members: Sequence[InstanceView]) -> list[InstanceView] | None:
    """The members in layer order when they tile the layers from 0 without a gap or overlap; else None."""
    if any(m.layers is None for m in members):
        return None
    ordered = sorted(members, key=lambda m: m.layers)  # type: ignore[arg-type, return-value]
    expect = 0
    for m in ordered:
        start, end = m.layers  # type: ignore[misc]
        if start != expect or end <= start:
            return None
        expect = end
    return ordered


def pool(members: Sequence[InstanceView], group_batch: GroupBatch = summed_batch) -> InstanceView | None:
    """One group as one instance: the entry's ids, pooled KV and load, §4.3's batch limit; None when
    the members seen do not make a runnable pipeline."""
    ordered = stages(members)
    if ordered is None or len({m.model for m in ordered}) != 1:
        return None
    entry = ordered[0]
    known = [m.adapters for m in ordered if m.adapters is not None]
    adapters = frozenset.intersection(*known) if known else None  # every stage applies the adapter
    return msgspec.structs.replace(
        entry, live=all(m.live for m in ordered),
        kv_blocks_used=sum(m.kv_blocks_used for m in ordered), kv_blocks_total=sum(m.kv_blocks_total for m in ordered),
        queued_prompt_tokens=sum(m.queued_prompt_tokens for m in ordered),
        running_requests=sum(m.running_requests for m in ordered),
        waiting_requests=sum(m.waiting_requests for m in ordered),
        resident_adapters=frozenset.intersection(*(m.resident_adapters for m in ordered)), adapters=adapters,
        max_batch=max(1, group_batch(len(ordered), entry.max_batch)),
        running_ranks=tuple(r for m in ordered for r in m.running_ranks),
        waiting_ranks=tuple(r for m in ordered for r in m.waiting_ranks),
        layers=(0, ordered[-1].layers[1]),  # type: ignore[index]
    )


__all__ = ["GroupBatch", "collapse_groups", "pool", "profiled_batch", "stages", "summed_batch"]
