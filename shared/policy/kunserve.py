"""KunServe's drop plan (§4.1 Alg. 1, §4.3 max batch) as a pure policy: instances in, groups out.

`plan_drop(loads, profile)` takes one model's instances (`InstanceLoad`: layer count, bytes per
layer, KV capacity, used, growth rate, queued KV) and a pipeline cost model
(`PipelineProfile`), computes the additional memory R the instances need `horizon_s` ahead
(1 s, §4.3), picks group sizes (throughput-greedy Alg. 1 by default; memory-greedy and the
exhaustive optimum for the Fig. 16 ablation), puts the instances short of memory into the
groups, and gives each member a contiguous range of layers to keep, complementary across the
group (one copy of the model per group). The result, a `DropPlan`, says what each member drops
and frees, its batch limit, the modeled throughput, and whether R was met; when it cannot be,
the plan frees the most the profile's deepest pipeline allows and says by how much it falls
short (the caller then scales out, §4.3). `plan_actions` turns it into the planner's wire
actions (`FormGroup`, `DropInstanceLayers`). The monitor that decides *when* is
`kunserve_monitor`. Pure: no I/O, no clock.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import msgspec

from shared.events.base import ID_PATTERN
from shared.events.common import GroupMember, LayerRange
from shared.events.plan import DropInstanceLayers, FormGroup, PlanAction
from shared.policy.kunserve_groups import (
    freed_bytes, member_max_batch, memory_greedy_sizes, optimal_sizes, throughput_greedy_sizes,
)
from shared.policy.kunserve_layers import assign_members, dropped_ranges, member_budget, split_layers
from shared.policy.kunserve_load import DEFAULT_HORIZON_S, InstanceLoad, total_deficit
from shared.policy.kunserve_profile import MAX_STAGES, PipelineProfile

Strategy = Literal["throughput_greedy", "memory_greedy", "optimal"]
STRATEGIES: tuple[str, ...] = ("throughput_greedy", "memory_greedy", "optimal")


class MemberDrop(msgspec.Struct, frozen=True, kw_only=True):
    member: GroupMember  # worker, instance and the layers it keeps
    dropped: list[LayerRange]  # the layers whose weights it releases (up to two ranges)
    freed_bytes: int
    max_batch: int  # §4.3: requests it admits as the group's entry; the rest overflow to the dispatcher
    projected_demand_bytes: int  # its KV demand `horizon_s` ahead, when planned

    @property
    def instance_id(self) -> str:
        return self.member.instance_id


class GroupDrop(msgspec.Struct, frozen=True, kw_only=True):
    group_id: str
    members: list[MemberDrop]  # in layer order: members[0] runs the first layers (the entry)
    freed_bytes: int
    throughput: float  # modeled, in unsplit-instance units: k x efficiency(k)
    max_batch: int  # the group's batch limit: its members' summed

    @property
    def stages(self) -> int:
        return len(self.members)


class DropPlan(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    strategy: Strategy
    demand_bytes: int  # R: what the instances lack `horizon_s` ahead
    freed_bytes: int
    feasible: bool  # freed_bytes >= demand_bytes
    shortfall_bytes: int  # demand the plan cannot free (0 when feasible): scale out for it
    group_sizes: list[int]  # every group, largest first, unsplit instances as 1s
    groups: list[GroupDrop]  # the buddy groups to form (two or more members)
    unsplit: list[str]  # instance ids that stay as they are
    already_grouped: list[str]  # instances in a group before this plan: not planned again
    throughput: float  # modeled, unsplit-instance units (len(loads) with no groups)
    cost: float  # §4.1's Cost: unsplit throughput over grouped (1.0 = no loss)
    reason: str


def plan_drop(loads: Sequence[InstanceLoad], profile: PipelineProfile, *, strategy: Strategy = "throughput_greedy",
              horizon_s: float = DEFAULT_HORIZON_S, target_usage: float = 1.0, required_bytes: int | None = None,
              unsplit_max_batch: int = 64, group_id_prefix: str = "bg") -> DropPlan:
    """The buddy groups that free enough memory for one model's projected KV demand at the highest
    modeled throughput (`strategy` picks the variant). `required_bytes` overrides R."""
    model, num_layers, layer_bytes = _check_loads(loads, strategy, group_id_prefix)
    grouped = sorted(l.instance_id for l in loads if l.grouped)
    free = [l for l in loads if not l.grouped]
    demand = total_deficit(free, horizon_s, target_usage) if required_bytes is None else required_bytes
    if demand < 0:
        raise ValueError(f"required_bytes must be >= 0, got {demand}")
    if not free:
        return DropPlan(model=model, strategy=strategy, demand_bytes=demand, freed_bytes=0, feasible=demand == 0,
                        shortfall_bytes=demand, group_sizes=[], groups=[], unsplit=[], already_grouped=grouped,
                        throughput=0.0, cost=1.0, reason="every instance is already in a buddy group")
    n, param = len(free), num_layers * layer_bytes
    max_group = min(profile.max_stages, num_layers, MAX_STAGES)
    if strategy == "throughput_greedy":
        sizes = throughput_greedy_sizes(n, param, demand, max_group, profile)
    elif strategy == "memory_greedy":
        sizes = memory_greedy_sizes(n, param, demand, max_group, kv_region=sum(l.kv_capacity_bytes for l in free))
    else:
        sizes = optimal_sizes(n, param, demand, max_group, profile)
    freed = freed_bytes(sizes, param)
    groups, unsplit = [], []
    for members in assign_members(free, sizes, horizon_s):
        if len(members) == 1:
            unsplit.append(members[0].instance_id)
            continue
        groups.append(_group(f"{group_id_prefix}-{len(groups)}", members, profile, horizon_s, unsplit_max_batch))
    throughput = profile.throughput(sizes)
    shortfall = max(0, demand - freed)
    shape = ", ".join(f"{sizes.count(k)}x{k}" for k in sorted(set(sizes), reverse=True))
    reason = (f"{model}: {n} instances -> {len(sizes)} groups ({shape}) by {strategy}: frees {freed} B for "
              f"{demand} B projected {horizon_s:g} s ahead; modeled throughput {throughput:.2f}/{n}"
              + ("" if shortfall == 0 else f"; {shortfall} B short (the deepest pipeline is {max_group})"))
    return DropPlan(model=model, strategy=strategy, demand_bytes=demand, freed_bytes=freed, feasible=shortfall == 0,
                    shortfall_bytes=shortfall, group_sizes=sizes, groups=groups, unsplit=sorted(unsplit),
                    already_grouped=grouped, throughput=throughput, cost=profile.cost(sizes), reason=reason)


def _group(group_id: str, members: list[InstanceLoad], profile: PipelineProfile, horizon_s: float,
           unsplit_max_batch: int) -> GroupDrop:
    k = len(members)
    num_layers, layer_bytes = members[0].num_layers, members[0].layer_bytes
    batch = member_max_batch(k, unsplit_max_batch, profile)
    drops = []
    for load, (start, end) in zip(members, split_layers(num_layers, [member_budget(m) for m in members])):
        dropped = dropped_ranges(num_layers, (start, end))
        drops.append(MemberDrop(
            member=GroupMember(worker_id=load.worker_id, instance_id=load.instance_id,
                               layers=LayerRange(start=start, end=end)),
            dropped=[LayerRange(start=a, end=b) for a, b in dropped],
            freed_bytes=sum(b - a for a, b in dropped) * layer_bytes, max_batch=batch,
            projected_demand_bytes=int(load.projected_demand(horizon_s))))
    return GroupDrop(group_id=group_id, members=drops, freed_bytes=sum(d.freed_bytes for d in drops),
                     throughput=profile.group_throughput(k), max_batch=batch * k)


def plan_actions(plan: DropPlan) -> list[PlanAction]:
    """The planner's actions, in order: per group, FormGroup, then each member's DropInstanceLayers."""
    actions: list[PlanAction] = []
    for group in plan.groups:
        actions.append(FormGroup(group_id=group.group_id, model=plan.model, members=[m.member for m in group.members]))
        actions += [DropInstanceLayers(worker_id=m.member.worker_id, instance_id=m.member.instance_id,
                                       group_id=group.group_id, layers=r)
                    for m in group.members for r in m.dropped]
    return actions


def _check_loads(loads: Sequence[InstanceLoad], strategy: str, prefix: str) -> tuple[str, int, int]:
    if not loads:
        raise ValueError("a drop plan needs at least one instance")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not re.match(ID_PATTERN, f"{prefix}-{len(loads)}"):
        raise ValueError(f"group_id_prefix {prefix!r} does not make valid group ids ({ID_PATTERN})")
    first = loads[0]
    for load in loads:
        if (load.model, load.num_layers, load.layer_bytes) != (first.model, first.num_layers, first.layer_bytes):
            raise ValueError(f"a drop plan is per model: instance {load.instance_id} is {load.model!r} with "
                             f"{load.num_layers} layers of {load.layer_bytes} B, instance {first.instance_id} is "
                             f"{first.model!r} with {first.num_layers} layers of {first.layer_bytes} B")
    ids = [l.instance_id for l in loads]
    if len(set(ids)) != len(ids):
        raise ValueError(f"instance ids must be unique, got {sorted(ids)}")
    return first.model, first.num_layers, first.layer_bytes


__all__ = ["DropPlan", "GroupDrop", "MemberDrop", "STRATEGIES", "Strategy", "plan_actions", "plan_drop"]
