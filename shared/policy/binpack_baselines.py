"""The baselines of MELL's evaluation (§VIII-B) as pure KV-packing policies.

Same operation API as `MellScheduler` (allocate / depart / update / run_batch), so the
simulator drives all of them alike (bookkeeping in binpack_base.py):

- BF (best fit): an arriving request goes to the active device with the least but sufficient
  free memory; running requests are never migrated.
- WF (worst fit): the active device with the most free memory (vLLM/Splitwise-style dispatch
  to the least-loaded instance); never migrates.
- LB (load balancing): worst fit plus Llumnix's KV-migration load balancing (binpack_lb.py).

All three activate a new device when nothing fits and terminate a device when it is idle.

"Sufficient memory" for BF and WF is the request's final KV footprint (prompt + output):
without migration a device can only guarantee that the requests it admitted still fit as
they grow if it reserves their growth at admission (a real system reserves prompt +
max_tokens; the trace-driven simulator knows the output length). The reservation is held
against capacity but is not `used` memory, so it lowers BF/WF's utilisation as it should.
`final_size` maps request ids to that footprint; without it the size given to `allocate` is
taken as the footprint. A request that grows past its reservation is a caller error.

BF-restart and WF-restart are an ablation, not the paper's baselines: they admit a request
at its current size and, when requests outgrow a device, preempt its newest requests and
restart them on another device by the same fit rule (vLLM's recompute preemption,
re-dispatched) - free, unlimited repacking that the paper's BF/WF do not have. Their moves
are restarts (`migrates` is False), counted apart from migrations.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.policy.binpack_base import BinPackPolicy
from shared.policy.binpack_lb import LoadBalance, worst_fit
from shared.policy.mell_ops import NoCapacity

__all__ = ["BASELINES", "BestFit", "BestFitRestart", "BinPackPolicy", "LoadBalance", "NoCapacity",
           "WorstFit", "WorstFitRestart"]


def best_fit(policy: BinPackPolicy, charge: int, exclude: str | None) -> str | None:
    """The active device with the least free memory that still fits `charge` (first activated wins ties)."""
    best, best_free = None, policy.capacity + 1
    for d in policy._order:
        free = policy.capacity - policy._load[d]
        if charge <= free < best_free and d != exclude:
            best, best_free = d, free
    return best


class BestFitRestart(BinPackPolicy):
    """Best fit at current size; an overflowing device restarts its newest requests elsewhere."""

    name = "BF-restart"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return best_fit(self, charge, exclude)


class WorstFitRestart(BinPackPolicy):
    """Worst fit at current size; an overflowing device restarts its newest requests elsewhere."""

    name = "WF-restart"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return worst_fit(self, charge, exclude)


class _Reserving(BinPackPolicy):
    """Admission reserves the request's final KV footprint; the device never overflows, never migrates."""

    def __init__(self, capacity: int, devices: Sequence[str] | None = None, *,
                 final_size: Mapping[str, int] | None = None) -> None:
        super().__init__(capacity, devices)
        self._final = final_size

    def _admission_charge(self, request_id: str, size: int) -> int:
        if self._final is None:
            return size
        final = self._final.get(request_id)
        if final is None:
            raise ValueError(f"{self.name}: no final size for request {request_id!r} (needed to reserve its growth)")
        if not size <= final <= self.capacity:
            raise ValueError(f"{self.name}: request {request_id!r}: final size {final} must be in "
                             f"[size {size}, capacity {self.capacity}]")
        return final

    def _growth_charge(self, request_id: str, size: int, charge: int) -> int:
        if size > charge:
            raise ValueError(f"{self.name}: request {request_id!r} grew to {size} B, past the {charge} B reserved "
                             "at admission (BF/WF do not migrate: give its final size)")
        return charge


class BestFit(_Reserving):
    name = "BF"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return best_fit(self, charge, exclude)


class WorstFit(_Reserving):
    name = "WF"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return worst_fit(self, charge, exclude)


BASELINES: dict[str, type[BinPackPolicy]] = {"BF": BestFit, "WF": WorstFit, "LB": LoadBalance,
                                             "BF-restart": BestFitRestart, "WF-restart": WorstFitRestart}
# the paper's baselines, which the summary line compares MELL against
PAPER_BASELINES = ("BF", "WF", "LB")
