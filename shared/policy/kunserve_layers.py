"""Who goes in which buddy group, and which layers each member keeps (KunServe §4.1, §4.2).

* Members: the instances short of memory go into the multi-member groups first (the memory a
  group frees serves that group's requests), and within them the load is balanced: hottest
  first, each to the group with the least projected demand so far, so a hot instance pairs with
  a cooler one whose spare KV the group pools. The rest stay unsplit.
* Layers: a group keeps exactly one copy of the model (every layer kept by exactly one member),
  as contiguous ranges in member order (member 0 runs layers [0, a), member 1 [a, b), ...; the
  first stage is the group's entry, §4.2). A member keeps a share of the layers proportional
  to its memory budget (KV capacity + decoder weights), so members of unequal room fill evenly;
  equal budgets give an even split. Every member keeps at least one layer.

Pure: values in, values out.
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.kunserve_load import DEFAULT_HORIZON_S, InstanceLoad


def split_layers(num_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous, complementary [start, end) ranges over num_layers, one per weight, sized by
    largest remainder in proportion to the weights, each at least one layer."""
    k = len(weights)
    if k < 1:
        raise ValueError("split_layers needs at least one member")
    if k > num_layers:
        raise ValueError(f"{k} members cannot each keep a layer of a {num_layers}-layer model")
    if any(w < 0 for w in weights):
        raise ValueError(f"member weights must be >= 0, got {list(weights)}")
    total = sum(weights)
    exact = [num_layers * w / total for w in weights] if total > 0 else [num_layers / k] * k
    counts = [max(1, int(e)) for e in exact]
    # hand out (or take back) layers by largest remainder, never below one per member
    order = sorted(range(k), key=lambda i: (-(exact[i] - int(exact[i])), i))
    spare = num_layers - sum(counts)
    step = 0
    while spare > 0:
        counts[order[step % k]] += 1
        spare -= 1
        step += 1
    while spare < 0:
        i = max((i for i in range(k) if counts[i] > 1), key=lambda i: (counts[i] - exact[i], -i))
        counts[i] -= 1
        spare += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def dropped_ranges(num_layers: int, kept: tuple[int, int]) -> list[tuple[int, int]]:
    """The layers outside `kept`: up to two ranges (before and after it)."""
    start, end = kept
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"kept layers [{start}, {end}) are not inside a {num_layers}-layer model")
    return [r for r in ((0, start), (end, num_layers)) if r[1] > r[0]]


def assign_members(loads: Sequence[InstanceLoad], sizes: Sequence[int],
                   horizon_s: float = DEFAULT_HORIZON_S) -> list[list[InstanceLoad]]:
    """Instances into groups of the given sizes (same total). Multi-member groups come first in
    the result, largest first; each group's members are in layer order (by worker, instance)."""
    if sum(sizes) != len(loads):
        raise ValueError(f"group sizes {list(sizes)} do not add up to the {len(loads)} instances")
    hottest = sorted(loads, key=lambda l: (-l.deficit(horizon_s), -_usage(l, horizon_s), l.instance_id))
    ordered_sizes = sorted(sizes, reverse=True)
    groups: list[list[InstanceLoad]] = [[] for _ in ordered_sizes]
    demand = [0.0] * len(groups)
    multi = [i for i, s in enumerate(ordered_sizes) if s > 1]
    slots = sum(ordered_sizes[i] for i in multi)
    for load in hottest[:slots]:
        open_groups = [i for i in multi if len(groups[i]) < ordered_sizes[i]]
        # the open group with the least demand per member so far (a cooler partner for a hot one)
        g = min(open_groups, key=lambda i: (demand[i] / ordered_sizes[i], len(groups[i]), i))
        groups[g].append(load)
        demand[g] += load.projected_demand(horizon_s)
    singles = [i for i, s in enumerate(ordered_sizes) if s == 1]
    for g, load in zip(singles, hottest[slots:]):
        groups[g].append(load)
    return [sorted(g, key=lambda l: (l.worker_id, l.instance_id)) for g in groups]


def _usage(load: InstanceLoad, horizon_s: float) -> float:
    capacity = load.projected_capacity(horizon_s)
    return load.projected_demand(horizon_s) / capacity if capacity else float("inf")


def member_budget(load: InstanceLoad) -> float:
    """What a member can hold of weights and KV: its share of the layers follows it."""
    return load.kv_capacity_bytes + load.param_bytes - load.dropped_bytes


__all__ = ["assign_members", "dropped_ranges", "member_budget", "split_layers"]
