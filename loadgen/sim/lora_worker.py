"""A simulated worker whose steps pay for the LoRA kernels of its batch (CaraServe §5, Fig. 9).

The step time is the base worker's (KV reads, prefill attention: loadgen/sim/profile.py) plus
exactly the linear model the rank-aware router uses (shared/policy/lora_perf_model.py):

    decode:  LoraPerfModel.decode_s(ranks of the decoding sequences)   padded: alpha |S| max rank
                                                                       segmented: alpha sum of ranks
    prefill: LoraPerfModel.prefill_s((tokens, rank) of this step's chunks)

(each with its beta; a request without an adapter has rank 0). So the simulator and the router
agree on what a batch costs; the base profile then carries no weights-read overhead of its own
(its `overhead_s` is 0 in the CaraServe profile: the model's beta is that).

A cold adapter (not resident on the worker) is loaded inside the step that admits its request,
which that step waits for: `adapter_load_s(name)` seconds, from the one movement cost model
(`adapter_load_times`: `MovementCosts.load_s` of the adapter's bytes over the profile's host
link). Without it, the WorkerSpec's flat `adapter_load_s` (the generic SimWorker's) applies.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loadgen.sim.profile import StepCost, WorkerSpec
from loadgen.sim.worker import SimWorker
from shared.policy.lora_perf_model import LoraPerfModel
from shared.policy.movement import MovementCosts


MIN_STEP_S = 1e-4


@dataclass(frozen=True)
class LoraGeometry:
    """What sizes a LoRA adapter: the base model's hidden size and layers, the projections it
    targets (square hidden x hidden ones, as Llama-2's q/k/v/o) and the weights' dtype."""

    hidden: int
    layers: int
    targets: int  # adapted projections per layer
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.targets, self.dtype_bytes) < 1:
            raise ValueError(f"LoraGeometry: hidden, layers, targets and dtype_bytes must be >= 1, got {self}")

    def adapter_bytes(self, rank: int) -> int:
        """A (hidden x rank) and B (rank x hidden) per targeted projection per layer."""
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        return self.layers * self.targets * 2 * self.hidden * rank * self.dtype_bytes


def adapter_load_times(costs: MovementCosts, geometry: LoraGeometry, ranks: dict[str, int], *,
                       in_host_memory: bool = True) -> Callable[[str], float]:
    """Adapter name -> its load time onto the device (host memory, or disk first)."""
    by_rank = {r: costs.load_s(geometry.adapter_bytes(r), in_host_memory=in_host_memory) for r in set(ranks.values())}

    def load_s(name: str) -> float:
        rank = ranks.get(name)
        if rank is None:
            raise KeyError(f"adapter {name!r} has no rank: cannot size its load")
        return by_rank[rank]
    return load_s


class LoraSimWorker(SimWorker):
    def __init__(self, index: int, worker_id: str, model: str, spec: WorkerSpec, cost: StepCost, max_run_s: float,
                 *, lora: LoraPerfModel, ranks: dict[str, int],
                 adapter_load_s: Callable[[str], float] | None = None) -> None:
        super().__init__(index, worker_id, model, spec, cost, max_run_s)
        self.lora = lora
        self.ranks = ranks
        self.adapter_load_s = adapter_load_s
        self.adapter_load_total_s = 0.0  # time steps waited for adapter loads

    def _use_adapter(self, name: str) -> float:
        cold = name not in self.adapters
        flat = super()._use_adapter(name)  # residency (LRU) and the load count
        if not cold:
            return flat
        load = flat if self.adapter_load_s is None else self.adapter_load_s(name)
        self.adapter_load_total_s += load
        return load

    def extra_step_s(self, chunks) -> float:
        rk = self.ranks
        decoding = [rk.get(e[3].adapter, 0) if e[3].adapter else 0 for e in self.heap if e[2] == e[3].epoch]
        extra = self.lora.decode_s(decoding)
        if chunks:
            extra += self.lora.prefill_s([(n, rk.get(req.adapter, 0) if req.adapter else 0) for req, n, _ in chunks])
        # a measured fit's intercept may be negative (short prefills): a step still takes some time
        return max(extra, MIN_STEP_S) if decoding or chunks else 0.0


def lora_worker_factory(lora: LoraPerfModel, ranks: dict[str, int],
                        adapter_load_s: Callable[[str], float] | None = None):
    """What `Simulator(make_worker=...)` takes: builds LoraSimWorkers with this model, these ranks
    and these adapter load times."""
    def make(index: int, worker_id: str, model: str, spec: WorkerSpec, cost: StepCost, max_run_s: float) -> SimWorker:
        return LoraSimWorker(index, worker_id, model, spec, cost, max_run_s, lora=lora, ranks=ranks,
                             adapter_load_s=adapter_load_s)
    return make


__all__ = ["LoraGeometry", "LoraSimWorker", "adapter_load_times", "lora_worker_factory"]
