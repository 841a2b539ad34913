"""State of the economy simulator: what each arm may buy, and every instance's memory pool.

An instance on tp GPUs owns tp x the GPU's usable bytes. Its pool holds, in bytes:

    weights  = the fleet's weights per GPU x tp, less the layers dropped into a buddy group
    adapter  = its resident LoRA adapters (LoraGeometry bytes by rank)
    prewarm  = KV blocks lent to prewarmed replicas of other models (WarmServe, grace period)
    KV       = the engine's `total` blocks: whatever the rest leaves, in whole blocks

so a change to any part moves the engine's KV budget (`EconomyWorker.plan` re-reads it at every step
boundary; a budget below the blocks in use preempts, as vLLM does when it runs out).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.sim.profile import StepCost
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker

UNBOUNDED_BLOCKS = 1 << 40  # the lower bound's KV: never runs out


@dataclass(frozen=True)
class ArmConfig:
    """Which sources an arm may use, and how it chooses (`mode`)."""

    name: str
    mode: str  # "single" (each source on its own trigger), "fixed" (the planner's order), "arbiter", "unbounded"
    prewarm: str = "none"  # FleetSystem.prewarm: "proactive" = WarmServe's planner
    prewarm_evict: bool = False  # a lent replica may be evicted to give its KV back
    cpu_assist: bool = False  # CaraServe: a cold adapter's prefill starts on CPU, the batch does not stall
    adapter_evict: bool = False  # resident adapters may be evicted to give KV
    layer_drop: bool = False  # KunServe
    migrate: bool = False  # MELL / Llumnix
    scale_out: bool = False  # a start bought for a worker's memory-blocked requests

    @property
    def sources(self) -> tuple[str, ...]:
        have = {"prewarm": self.prewarm_evict, "adapter": self.adapter_evict, "layers": self.layer_drop,
                "migrate": self.migrate, "scale_out": self.scale_out}
        return tuple(k for k, v in have.items() if v)


# The non-memory base every arm shares (issue 32): WarmServe's prewarm planner and CaraServe's
# CPU-assisted cold adapters are on in every arm, so an arm differs from another only by the memory
# sources it may buy from and how it chooses (before, CPU assist was on in 3 arms and the planner in 3
# others, and the arm-to-arm gaps were mostly that base).
BASE = dict(prewarm="proactive", cpu_assist=True)
ALL_SOURCES = dict(prewarm_evict=True, adapter_evict=True, layer_drop=True, migrate=True, scale_out=True)
ARM_CONFIGS = {a.name: a for a in (
    ArmConfig("kunserve", "single", layer_drop=True, **BASE),
    ArmConfig("mell", "single", migrate=True, **BASE),
    ArmConfig("caraserve", "single", adapter_evict=True, **BASE),
    ArmConfig("warmserve", "single", prewarm_evict=True, **BASE),
    ArmConfig("fixed-order", "fixed", **ALL_SOURCES, **BASE),
    ArmConfig("arbiter", "arbiter", **ALL_SOURCES, **BASE),
    ArmConfig("unbounded", "unbounded", **BASE),
)}
# Ablations of the arbiter (options of the repro, not default arms): leave one source out, and "needs in
# fixed order" (the arbiter's needs, bought from every source in the fixed order SOURCES, prices ignored)
ABLATIONS = {a.name: a for a in (
    *(ArmConfig(f"arbiter-no-{src}", "arbiter", **{**ALL_SOURCES, key: False}, **BASE)
      for src, key in (("prewarm", "prewarm_evict"), ("adapter", "adapter_evict"), ("layers", "layer_drop"),
                       ("migrate", "migrate"), ("scale_out", "scale_out"))),
    ArmConfig("needs-fixed-order", "fixed-needs", **ALL_SOURCES, **BASE),
)}


@dataclass(eq=False)
class Pool:
    """One instance's device memory (all its GPUs together), in bytes."""

    capacity: int  # usable bytes x tp
    weights: int  # full weights as placed (per-GPU share x tp)
    block_bytes: int
    dropped: int = 0  # weights given to KV by a layer drop
    adapters: dict[str, int] = field(default_factory=dict)  # resident adapter -> bytes
    lent_blocks: int = 0  # KV lent to prewarmed replicas (mirrors Instance.kv_lent_blocks)
    unbounded: bool = False

    @property
    def adapter_bytes(self) -> int:
        return sum(self.adapters.values())

    def kv_blocks(self, dropped: int | None = None) -> int:
        """The KV budget these parts leave (with `dropped` instead of the current drop, if given)."""
        if self.unbounded:
            return UNBOUNDED_BLOCKS
        d = self.dropped if dropped is None else dropped
        free = self.capacity - self.weights + d - self.adapter_bytes - self.lent_blocks * self.block_bytes
        return max(0, free // self.block_bytes)


def scaled(cost: StepCost, factor: float) -> StepCost:
    """Every term of a step x factor (a pipelined buddy runs at step time / efficiency)."""
    return StepCost(overhead_s=cost.overhead_s * factor, decode_per_seq_s=cost.decode_per_seq_s * factor,
                    decode_per_ctx_token_s=cost.decode_per_ctx_token_s * factor,
                    prefill_per_token_s=cost.prefill_per_token_s * factor, prefill_attn_s=cost.prefill_attn_s * factor)


# (worker, adapter, the request admitting it) -> seconds the admitting step waits
ColdAdapter = Callable[["EconomyWorker", str, SimRequest], float]


class EconomyWorker(SimWorker):
    """A vLLM-0.6 engine whose KV budget is what its pool leaves, and whose cold adapters go through
    the simulator's one adapter path (`on_cold`: load inline, or CaraServe's CPU-assisted prefill)."""

    pool: Pool
    on_cold: ColdAdapter
    all_resident: bool = False

    def plan(self, now: float) -> float | None:
        self.total = self.pool.kv_blocks()
        return super().plan(now)

    def _use_adapter(self, name: str) -> float:
        if self.all_resident:
            return 0.0
        if name in self.adapters:
            self.adapters.move_to_end(name)
            return 0.0
        req = self.prefilling[-1]  # both engine modes append the admitted request before asking for its adapter
        return self.on_cold(self, name, req)

    def running_adapters(self) -> set[str]:
        live = [e[3] for e in self.heap if e[2] == e[3].epoch]
        return {r.adapter for r in (*live, *self.prefilling) if r.adapter}

    def running(self) -> int:
        return self.decoding + len(self.prefilling)

    def step_s(self) -> float:
        return self.c_over + self.c_seq * self.decoding + self.c_ctx * self.ctx_sum


__all__ = ["ABLATIONS", "ARM_CONFIGS", "BASE", "ArmConfig", "EconomyWorker", "Pool", "UNBOUNDED_BLOCKS", "scaled"]
