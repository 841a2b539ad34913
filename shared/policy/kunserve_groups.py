"""Group sizes of KunServe's drop plan (§4.1): Alg. 1 (throughput-greedy), memory-greedy, optimal.

A model's N unsplit instances are N groups of one. Merging two groups into one buddy group
lets the merged group keep a single copy of the parameters, so every merge frees P (one
replica's decoder layers): a configuration of g groups frees (N - g) x P whatever their sizes.
What the sizes change is throughput: a group of k serves k x efficiency(k) instances' worth
(`PipelineProfile`), and efficiency never rises with k, so

* Alg. 1 merges the two smallest groups until the freed memory covers the demand R: the fewest
  merges (most throughput) with near-balanced sizes ("8 instances -> 4 groups" when R = 4P);
  `throughput_greedy_sizes` then takes the best split into that many groups (an exact DP).
* the memory-greedy variant (the Fig. 16 ablation) grows one group at a time, as many
  instances as possible, until the freed memory exceeds the instances' original KV region.
* `optimal_sizes` searches every configuration (Fig. 16's "optimal" line).

Groups never exceed `max_group` members (the profile's deepest pipeline, the model's layer
count). When even the most merging cannot free R, each strategy frees the most it can; the
caller reports the shortfall (§4.1: "the algorithm can exit with requirements unmet").
Pure: sizes in, sizes out.
"""
from __future__ import annotations

import heapq
from functools import lru_cache

from shared.policy.kunserve_profile import PipelineProfile

MAX_OPTIMAL_INSTANCES = 40  # partitions of 40: 37,338; the exhaustive search is for ablations


def _check(n: int, param_bytes: int, required: float, max_group: int) -> None:
    if n < 1:
        raise ValueError(f"a drop plan needs at least one instance, got {n}")
    if param_bytes < 1:
        raise ValueError(f"param_bytes must be >= 1, got {param_bytes}")
    if required < 0:
        raise ValueError(f"required bytes must be >= 0, got {required}")
    if max_group < 1:
        raise ValueError(f"max_group must be >= 1, got {max_group}")


def freed_bytes(sizes: list[int], param_bytes: int) -> int:
    """Bytes a configuration frees: one replica's layers per merge, (N - g) x P."""
    return (sum(sizes) - len(sizes)) * param_bytes


def alg1_sizes(n: int, param_bytes: int, required: float, max_group: int) -> list[int]:
    """Algorithm 1: pop the two smallest groups, merge, push back, while |BG| > 1 and the freed
    memory is below R. A merge past `max_group` is not made (the loop ends there)."""
    _check(n, param_bytes, required, max_group)
    heap = [1] * n
    freed = 0
    while len(heap) > 1 and freed < required:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        if a + b > max_group:  # the two smallest do not fit, so no pair does
            heap += [a, b]
            break
        heapq.heappush(heap, a + b)
        freed += param_bytes
    return sorted(heap, reverse=True)


def memory_greedy_sizes(n: int, param_bytes: int, required: float, max_group: int, kv_region: float) -> list[int]:
    """Group as many instances as possible: merge the largest group that still has room with the
    smallest one, until the freed memory exceeds the original KV region `kv_region` (and R)."""
    _check(n, param_bytes, required, max_group)
    target = max(required, kv_region)
    sizes = [1] * n
    while len(sizes) > 1 and freed_bytes(sizes, param_bytes) < target:
        sizes.sort(reverse=True)
        smallest = sizes[-1]
        grow = next((i for i in range(len(sizes) - 1) if sizes[i] + smallest <= max_group), None)
        if grow is None:
            break
        sizes[grow] += smallest
        sizes.pop()
    return sorted(sizes, reverse=True)


def best_sizes(n: int, groups: int, max_group: int, profile: PipelineProfile) -> list[int] | None:
    """The highest-throughput split of n instances into exactly `groups` groups of <= max_group
    (ties: the most balanced); None when impossible."""
    if not 1 <= groups <= n or groups * max_group < n:
        return None
    return list(_best(n, groups, min(max_group, n), profile))


def _best(n: int, groups: int, cap: int, profile: PipelineProfile) -> tuple[int, ...]:
    @lru_cache(maxsize=None)
    def go(left: int, g: int, most: int) -> tuple[float, tuple[int, ...]] | None:
        # split `left` into g parts, non-increasing, each <= most
        if g == 0:
            return (0.0, ()) if left == 0 else None
        found: tuple[float, tuple[int, ...]] | None = None
        for k in range(min(most, left - (g - 1)), 0, -1):
            if k * g < left:
                break
            rest = go(left - k, g - 1, k)
            if rest is None:
                continue
            value = profile.group_throughput(k) + rest[0]
            # smaller parts first in the loop (k descends): a tie keeps the later, more balanced one
            if found is None or value >= found[0] - 1e-12:
                found = (value, (k, *rest[1]))
        return found

    result = go(n, groups, cap)
    assert result is not None  # feasibility checked by the caller
    return result[1]


def throughput_greedy_sizes(n: int, param_bytes: int, required: float, max_group: int,
                            profile: PipelineProfile) -> list[int]:
    """Alg. 1's configuration, refined: with as many groups, the split the profile models best
    (Alg. 1 is "near-optimal": 6 instances, 4 merges give [4, 2], and [3, 3] serves more), and
    when Alg. 1 stops short under the stage cap ([2, 2, 2] with at most 3 stages: the two
    smallest make 4), the fewest groups the cap allows, so it frees the most it can."""
    sizes = alg1_sizes(n, param_bytes, required, max_group)
    fewest = -(-n // max_group)
    if freed_bytes(sizes, param_bytes) < required and len(sizes) > fewest:
        sizes = best_sizes(n, fewest, max_group, profile) or sizes  # free the most the cap allows
    best = best_sizes(n, len(sizes), max_group, profile)
    if best is not None and profile.throughput(best) > profile.throughput(sizes) + 1e-9:
        return best
    return sizes


def optimal_sizes(n: int, param_bytes: int, required: float, max_group: int, profile: PipelineProfile) -> list[int]:
    """Every configuration searched: the highest throughput among those that free R, else the
    one that frees the most (highest throughput among those)."""
    _check(n, param_bytes, required, max_group)
    if n > MAX_OPTIMAL_INSTANCES:
        raise ValueError(f"optimal_sizes searches every partition: at most {MAX_OPTIMAL_INSTANCES} instances, got {n}")
    best: tuple[bool, int, float, list[int]] | None = None
    for sizes in _partitions(n, min(max_group, n)):
        freed = freed_bytes(sizes, param_bytes)
        key = (freed >= required, 0 if freed >= required else freed, profile.throughput(sizes), sizes)
        if best is None or key[:3] >= best[:3]:  # a tie goes to the later, more balanced one
            best = key
    assert best is not None
    return best[3]


def _partitions(n: int, most: int) -> list[list[int]]:
    if n == 0:
        return [[]]
    return [[k, *rest] for k in range(min(n, most), 0, -1) for rest in _partitions(n - k, k)]


def group_max_batch(stages: int, unsplit_max_batch: int, profile: PipelineProfile) -> int:
    """§4.3's batch limit of a k-member group: its k instances' worth of compute at the
    pipeline's efficiency (requests beyond it go back to the dispatcher for rebalancing)."""
    if unsplit_max_batch < 1:
        raise ValueError(f"unsplit_max_batch must be >= 1, got {unsplit_max_batch}")
    return max(stages, int(stages * unsplit_max_batch * profile.efficiency(stages)))


def member_max_batch(stages: int, unsplit_max_batch: int, profile: PipelineProfile) -> int:
    """One member's share of its group's limit: the requests it admits as the group's entry."""
    return max(1, group_max_batch(stages, unsplit_max_batch, profile) // stages)


__all__ = ["MAX_OPTIMAL_INSTANCES", "alg1_sizes", "best_sizes", "freed_bytes", "group_max_batch",
           "member_max_batch", "memory_greedy_sizes", "optimal_sizes", "throughput_greedy_sizes"]
