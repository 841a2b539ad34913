"""Prefix-aware routing: a request's cached prefix weighed against each instance's load (pure).

The cost of sending a request of P prompt tokens to an instance that holds its first m blocks
(block size b) is

    cost = weight x (P - m*b)  +  outstanding tokens of the instance

— the prefill it still has to do there, plus the work queued before it (tokens in its KV + prompt
tokens not yet prefilled, `outstanding`: the least-load policy's key, its KV in tokens). It is
the cost of Dynamo's KV router (`kv_overlap_score_weight` x prefill blocks + active blocks; its
default weight 1.0 is ours) and of llm-d's weighted prefix-cache + load scorers, in tokens. The
cheapest wins; ties go to fewer running requests, then the smaller instance id.

When no instance holds any block of the request, every instance's first term is the same, so the
choice is by load alone; the router then hands the request to the configured
routing policy unchanged (least load by default, or rank-aware, mell, ...): prefix-aware routing
only ever changes a decision where a prefix matches.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

from shared.events import SubmitRequest
from shared.policy.routing import InstanceView, RequestView, RoutingPolicy
from shared.prefix_hash import block_hashes, prefix_salt

from services.dispatcher.prefix_index import PrefixIndex

HASH_CACHE = 4096  # requests whose block hashes are kept (a queued request is placed again and again)


def outstanding(inst: InstanceView) -> float:
    """Tokens of work the instance holds: tokens in its KV + prompt tokens not yet prefilled. A worker counts
    KV blocks per layer (`kv_blocks_used`: one block is one layer's KV for block_size tokens), so the KV
    term is divided by the layers it holds, to be in the prefill term's unit (unknown layers: as given)."""
    layers = inst.layers[1] - inst.layers[0] if inst.layers is not None else 1
    return inst.kv_blocks_used * inst.block_size / max(layers, 1) + inst.queued_prompt_tokens


def prefix_cost(prompt_tokens: int, matched: int, inst: InstanceView, weight: float) -> float:
    """Uncached prefill there (weighted) + the instance's outstanding tokens."""
    uncached = max(prompt_tokens - matched * inst.block_size, 0)
    return weight * uncached + outstanding(inst)


def choose_by_cost(request: RequestView, instances: Sequence[InstanceView], matches: Mapping[str, int],
                   weight: float) -> str | None:
    """The cheapest eligible instance (live, the request's model, KV big enough for its prompt)."""
    best: tuple[float, int, str] | None = None
    for inst in instances:
        if not inst.live or inst.model != request.model or inst.kv_tokens_total < request.prompt_tokens:
            continue
        key = (prefix_cost(request.prompt_tokens, matches.get(inst.instance_id, 0), inst, weight),
               inst.running_requests, inst.instance_id)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


class PrefixRouter:
    """Wraps the configured policy: prefix cost where a prefix matches, the policy where none does."""

    def __init__(self, base: RoutingPolicy, index: PrefixIndex, *, weight: float = 1.0) -> None:
        self.base = base
        self.index = index
        self.weight = weight
        self.counts: Counter[str] = Counter()  # "prefix": routed by cost; "load": no match, the policy
        self._hashes: OrderedDict[tuple[str, int], list[int]] = OrderedDict()

    def hashes(self, submit: SubmitRequest, block_size: int) -> list[int]:
        """The request's full-block hashes at `block_size` (cached per request)."""
        key = (submit.request_id, block_size)
        found = self._hashes.get(key)
        if found is None:
            salt = prefix_salt(submit.model, submit.adapter)
            found = self._hashes[key] = block_hashes(submit.prompt_token_ids, block_size, salt)
            while len(self._hashes) > HASH_CACHE:
                self._hashes.popitem(last=False)
        return found

    def choose(self, submit: SubmitRequest, view: RequestView, instances: Sequence[InstanceView],
               now: float) -> str | None:
        matches: dict[str, int] = {}
        for inst in instances:
            bs = self.index.block_size(inst.instance_id, now) or inst.block_size
            matches[inst.instance_id] = self.index.match(inst.instance_id, self.hashes(submit, bs), now)
        if any(matches.values()):
            self.counts["prefix"] += 1
            chosen = choose_by_cost(view, instances, matches, self.weight)
        else:
            self.counts["load"] += 1
            chosen = self.base.choose(view, instances, now)
        if chosen is not None:
            target = next(i for i in instances if i.instance_id == chosen)
            bs = self.index.block_size(chosen, now) or target.block_size
            self.index.predict(chosen, self.hashes(submit, bs), now)
        return chosen


__all__ = ["PrefixRouter", "choose_by_cost", "outstanding", "prefix_cost"]
