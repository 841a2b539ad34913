"""Routing policies by name: the one place that knows every policy module (CaraServe's in
lora_routing, MELL's in routing_mell, the basic ones in routing), so none of those imports another
to build a policy (no import circle)."""
from __future__ import annotations

from collections.abc import Callable

from shared.policy import lora_routing, routing_mell
from shared.policy.lora_routing import RoutingOptions
from shared.policy.routing import HashRandom, LeastOutstandingWork, RoutingPolicy

POLICIES: dict[str, Callable[[int, RoutingOptions], RoutingPolicy]] = {
    "least-load": lambda seed, opts: LeastOutstandingWork(),
    "random": lambda seed, opts: HashRandom(seed),
    "rank-aware": lambda seed, opts: lora_routing.RankAware.from_options(opts),  # CaraServe Alg. 1
    "most-idle": lambda seed, opts: lora_routing.MostIdle(),
    "first-fit": lambda seed, opts: lora_routing.FirstFit(),
    "mell": lambda seed, opts: routing_mell.MellRouting(),  # the planner's placement hints (MELL's Allocate)
}


def make_policy(name: str, seed: int = 0, options: RoutingOptions | None = None) -> RoutingPolicy:
    """A routing policy by name (see POLICIES); `options` configure rank-aware (default: the
    paper's profile, the segmented kernel, no SLO)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(seed, options if options is not None else RoutingOptions())


__all__ = ["POLICIES", "make_policy"]
