"""Fig. 5's MBGMV model held to §5 beyond the measured batches, for the cold-start simulator.

CaraServe §2.3 / Fig. 5 give two decode batches per kernel on the A10 (24 x rank 32 and 16 x rank 64:
decode feature requests x rank = 768 and 1024). The two-point lines (profiles/lora/caraserve-a10-
llama2-7b.toml) are BGMV 31.8 ms + 3.906e-6 s x feature and MBGMV 33.5 ms + 2.344e-6 s x sum of ranks;
they cross at 1.7 ms / 1.5625e-6 s = 1088, so past 17 requests of rank 64 the lines would make MBGMV
cheaper than BGMV at uniform rank, against §5: MBGMV "eliminate[s] padding, improving performance with
highly heterogeneous LoRA ranks but introducing additional performance overhead for computing homogeneous
ranks" (a uniform batch has no padding to skip). The clamp: MBGMV's step is at least
BGMV's for a uniform batch of the same size and sum of ranks. Inside the fit's range (768-1024) the
lines already satisfy it, so nothing changes there; a mixed-rank batch keeps MBGMV's advantage.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.policy.lora_perf_model import LoraPerfModel

FIT_RANGE = (768, 1024)  # decode feature (requests x rank) of Fig. 5's measured batches


@dataclass(frozen=True)
class ClampedMbgmv:
    """MBGMV's model with decode >= BGMV's for a uniform batch of the same size and sum of ranks (§5:
    at uniform rank MBGMV never beats BGMV); Fig. 5's two-point lines cross at feature 1088."""
    mbgmv: LoraPerfModel
    bgmv: LoraPerfModel

    def decode_s(self, ranks) -> float:
        if not ranks:
            return 0.0
        uniform = [sum(ranks) / len(ranks)] * len(ranks)
        return max(self.mbgmv.decode_s(ranks), self.bgmv.decode_s(uniform))

    def prefill_s(self, prompts) -> float:
        return self.mbgmv.prefill_s(prompts)

    @property
    def decode(self):
        return self.mbgmv.decode


__all__ = ["FIT_RANGE", "ClampedMbgmv"]
