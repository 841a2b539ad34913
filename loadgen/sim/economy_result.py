"""What one run of the economy simulator (loadgen/sim/economy.py) gives back: per request latency,
every memory purchase with its price, and each GPU's pool by kind over time.

The arms (`ARMS`) share one base (the public WarmServe code's autoscaler, vLLM-0.6 engines that
preempt when KV runs out, WarmServe's prewarm planner, CaraServe's CPU-assisted cold adapters, weights
kept as a replica after a stop)
and differ only in which memory sources they may buy from and how they choose:

- one mechanism alone: `kunserve` (drop replicated layers into buddy pairs), `mell` (migrate
  requests between a model's instances), `caraserve` (evict LRU adapters for KV; cold ones start
  prefill on the CPU while loading, as in every arm), `warmserve` (evict a lent prewarm replica to
  give its KV back);
- `fixed-order`: all four, each on its own trigger, in the planner's fixed order
  (services/planner/policies.py);
- `arbiter`: all four, each need bought by `shared.policy.memory_market.buy` at prices from the
  same cost models;
- `unbounded`: the lower bound — every instance's KV never runs out and every adapter is resident
  (nothing to buy): what the same GPUs and autoscaler give when memory is free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SINGLE_ARMS = ("kunserve", "mell", "caraserve", "warmserve")
ARMS = (*SINGLE_ARMS, "fixed-order", "arbiter", "unbounded")
POOL_KINDS = ("weights", "prewarm", "adapter", "kv_used", "kv_free", "dropped")


@dataclass(frozen=True)
class PurchaseRecord:
    """Memory one arm acquired for a need: by price (arbiter) or by a mechanism's own trigger (the others,
    priced with the same functions after the fact, so the plots compare like with like)."""

    t: float
    scope: str  # "gpu:<i>" or "model:<name>"
    source: str  # one of shared.policy.memory_market.SOURCES
    target: str
    bytes: int
    price_request_s: float
    cheapest_unbought: str = ""  # arbiter: the cheapest offer it did not take ("source target price"), or ""


@dataclass(frozen=True)
class PoolSample:
    """One GPU's memory by kind at time t (bytes; `dropped`: weights given to KV by a layer drop)."""

    t: float
    gpu: int
    weights: int
    prewarm: int
    adapter: int
    kv_used: int
    kv_free: int
    dropped: int = 0


@dataclass
class EconomyResult:
    arm: str
    gpus: int
    models: list[str]
    model: np.ndarray  # per request: index into `models`
    ttft: np.ndarray  # seconds (NaN: never got a token)
    tpot: np.ndarray  # seconds per output token after the first (NaN: one token or failed)
    unloaded_ttft: np.ndarray  # per request: its prefill alone on a warm instance (the SLO's base)
    purchases: list[PurchaseRecord] = field(default_factory=list)
    pool: list[PoolSample] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # preemptions, migrations, groups, cold_adapters, ...
    arrival: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per request: seconds from the start
    preempted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per request: its preemptions

    def p99_ttft(self) -> float:
        ok = self.ttft[~np.isnan(self.ttft)]
        return float(np.percentile(ok, 99)) if ok.size else float("nan")

    def slo_attainment(self, scale: float, floor_s: float) -> float:
        """Share of requests whose TTFT is within max(scale x unloaded TTFT, floor_s) (a failed one misses)."""
        slo = np.maximum(scale * self.unloaded_ttft, floor_s)
        met = np.where(np.isnan(self.ttft), False, self.ttft <= slo)
        return float(met.mean()) if met.size else float("nan")


__all__ = ["ARMS", "EconomyResult", "POOL_KINDS", "PoolSample", "PurchaseRecord", "SINGLE_ARMS"]
