"""The arbiter's `prefix` offers (pure): a needy worker's cached-free prefix blocks, priced per instance.

Each instance on a worker with a need that reports cached-free prefix blocks (`InstanceView.
prefix_cached_free_*`, from the worker's stats) offers enough of them to cover the need (never more than
it holds), least recently used first as the engine evicts them: a `ReleasePrefixBlocks` decision (ctl
`EvictPrefixBlocks`). Its price is `prefix_price.price_prefix_eviction`: the instance's recent block hit
rate x the tokens those blocks hold x the cost profile's prefill seconds per token. Choosing among these
and every other source stays in the arbiter (`memory_market.buy`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import msgspec

from shared.events.plan import ReleasePrefixBlocks
from shared.planner.arbiter_offers import Pricing, kv_bytes_per_token
from shared.planner.effects import Decision
from shared.planner.view import ClusterView, InstanceView
from shared.policy.memory_market import Need
from shared.policy.prefix_price import blocks_for, price_prefix_eviction


@dataclass(frozen=True)
class PrefixOffer:
    decision: Decision
    target: str  # "<worker>/<instance>"
    bytes: int
    price: float  # request-seconds


def prefix_price(view: ClusterView, p: Pricing, inst: InstanceView, nbytes: int) -> float:
    """Releasing `nbytes` of the instance's cached prefix KV: its hit rate x their tokens' prefill."""
    per_token = kv_bytes_per_token(view, inst, p.settings.kv_block_tokens)
    tokens = int(nbytes / per_token) if per_token > 0 else 0
    chance = min(1.0, max(0.0, inst.prefix_hit_rate))
    return price_prefix_eviction(chance, tokens, p.prefill.prefill_per_token_s)


def prefix_offers(view: ClusterView, p: Pricing, need: Need) -> list[PrefixOffer]:
    """One offer per instance of the need's worker that holds cached-free prefix blocks (none for a model need)."""
    kind, _, wid = need.scope.partition(":")
    worker = view.workers.get(wid) if kind == "worker" else None
    if worker is None:
        return []
    out = []
    for inst in worker.instances:
        held, held_bytes = inst.prefix_cached_free_blocks, inst.prefix_cached_free_bytes
        if held <= 0 or held_bytes <= 0:
            continue
        block_bytes = max(1, held_bytes // held)
        n = blocks_for(need.bytes, held, block_bytes)
        nbytes = min(held_bytes, n * block_bytes)
        cost = prefix_price(view, p, inst, nbytes)
        d = Decision(action=ReleasePrefixBlocks(worker_id=wid, instance_id=inst.instance_id, blocks=n),
                     trigger="kv_pressure", freed_bytes=nbytes, modeled_cost=cost,
                     reason=f"the arbiter releases {n} cached prefix blocks of {inst.instance_id} on {wid} "
                            f"(hit rate {inst.prefix_hit_rate:.2f})")
        out.append(PrefixOffer(d, f"{wid}/{inst.instance_id}", nbytes, cost))
    return out


P = TypeVar("P")


def cut_prefix(proposal: P, nbytes: int) -> P:
    """A prefix proposal (anything with a `decision` field) cut to the blocks covering `nbytes`: the market
    bought only the part of a divisible offer a need still missed."""
    d: Decision = proposal.decision  # type: ignore[attr-defined]
    action = d.action
    if not isinstance(action, ReleasePrefixBlocks) or action.blocks <= 0 or nbytes >= d.freed_bytes:
        return proposal
    block_bytes = max(1, d.freed_bytes // action.blocks)
    n = max(1, min(action.blocks, -(-nbytes // block_bytes)))
    cut = replace(d, action=msgspec.structs.replace(action, blocks=n), freed_bytes=n * block_bytes,
                  modeled_cost=d.modeled_cost * n * block_bytes / d.freed_bytes)
    return replace(proposal, decision=cut)  # type: ignore[type-var]


__all__ = ["PrefixOffer", "cut_prefix", "prefix_offers", "prefix_price"]
