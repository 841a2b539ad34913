"""A simulated worker whose steps pay for the LoRA kernels of its batch (CaraServe §5, Fig. 9).

The step time is the base worker's (KV reads, prefill attention: loadgen/sim/profile.py) plus
exactly the linear model the rank-aware router uses (shared/policy/lora_perf_model.py):

    decode:  LoraPerfModel.decode_s(ranks of the decoding sequences)   padded: alpha |S| max rank
                                                                       segmented: alpha sum of ranks
    prefill: LoraPerfModel.prefill_s((tokens, rank) of this step's chunks)

(each with its beta; a request without an adapter has rank 0). So the simulator and the router
agree on what a batch costs; the base profile then carries no weights-read overhead of its own
(its `overhead_s` is 0 in the CaraServe profile: the model's beta is that).
"""
from __future__ import annotations

from loadgen.sim.profile import StepCost, WorkerSpec
from loadgen.sim.worker import SimWorker
from shared.policy.lora_perf_model import LoraPerfModel


MIN_STEP_S = 1e-4


class LoraSimWorker(SimWorker):
    def __init__(self, index: int, worker_id: str, model: str, spec: WorkerSpec, cost: StepCost, max_run_s: float,
                 *, lora: LoraPerfModel, ranks: dict[str, int]) -> None:
        super().__init__(index, worker_id, model, spec, cost, max_run_s)
        self.lora = lora
        self.ranks = ranks

    def extra_step_s(self, chunks) -> float:
        rk = self.ranks
        decoding = [rk.get(e[3].adapter, 0) if e[3].adapter else 0 for e in self.heap if e[2] == e[3].epoch]
        extra = self.lora.decode_s(decoding)
        if chunks:
            extra += self.lora.prefill_s([(n, rk.get(req.adapter, 0) if req.adapter else 0) for req, n, _ in chunks])
        # a measured fit's intercept may be negative (short prefills): a step still takes some time
        return max(extra, MIN_STEP_S) if decoding or chunks else 0.0


def lora_worker_factory(lora: LoraPerfModel, ranks: dict[str, int]):
    """What `Simulator(make_worker=...)` takes: builds LoraSimWorkers with this model and these ranks."""
    def make(index: int, worker_id: str, model: str, spec: WorkerSpec, cost: StepCost, max_run_s: float) -> SimWorker:
        return LoraSimWorker(index, worker_id, model, spec, cost, max_run_s, lora=lora, ranks=ranks)
    return make


__all__ = ["LoraSimWorker", "lora_worker_factory"]
