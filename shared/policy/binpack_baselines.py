"""The baselines of MELL's evaluation (§VIII-B) as pure KV-packing policies.

Same operation API as `MellScheduler` (allocate / depart / update / run_batch), so the
simulator drives all of them alike (bookkeeping in binpack_base.py):

- BF (best fit): an arriving request goes to the active device with the least but sufficient
  free memory; running requests are never migrated.
- WF (worst fit): the active device with the most free memory (vLLM/Splitwise-style dispatch
  to the least-loaded instance); never migrates.
- LB (load balancing): worst fit plus Llumnix's periodic load balancing by live KV migration
  (binpack_lb.py); LB-open (extra arm, Eq. 2 kept): LB that opens a GPU when no pair relieves an overflow.

All three activate a new device when no active device has the memory an arrival needs, and
terminate a device when it is idle.

"Sufficient memory" is what is known at arrival: the request's KV now (its prompt), against what
the device's requests hold now (running, and waiting for memory). Nobody knows the final length
(MELL Finding 2). When the requests admitted to a device outgrow it, nothing moves in the books:
the device's engine preempts its newest requests (vLLM's recompute preemption), which wait there
until memory frees and then re-prefill; the fleet simulation (loadgen/sim/kv_packing_fleet.py)
plays that out and charges the wait to their TTFT/TPOT. While a device's books hold more than C,
no arrival is put there.

Extra arms, not the paper's baselines:
- BF-reserve / WF-reserve: reserve each request's *final* KV footprint at admission (`final_size`),
  so a device never overflows. A real system cannot know it (hindsight); it is the upper end of
  what a reservation-based BF/WF could do (a real one would reserve prompt + max_tokens, more).
- BF-restart / WF-restart: admit at the current size and, when requests outgrow a device, preempt
  its newest requests and restart them on another device by the same fit rule (re-dispatched
  recompute): repacking by re-prefill (`migrates` is False; the moves are restarts).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.policy.binpack_base import BinPackPolicy
from shared.policy.binpack_lb import LoadBalance, LoadBalanceOpen, worst_fit
from shared.policy.mell_ops import Move, NoCapacity

__all__ = ["BASELINES", "BestFit", "BestFitReserve", "BestFitRestart", "BinPackPolicy", "LoadBalance",
           "LoadBalanceOpen", "NoCapacity",
           "WorstFit", "WorstFitReserve", "WorstFitRestart"]


def best_fit(policy: BinPackPolicy, charge: int, exclude: str | None) -> str | None:
    """The active device with the least free memory that still fits `charge` (first activated wins ties)."""
    best, best_free = None, policy.capacity + 1
    for d in policy._order:
        free = policy._free(d)
        if charge <= free < best_free and d != exclude:
            best, best_free = d, free
    return best


class BestFit(BinPackPolicy):
    """Best fit at the current size; an overflowing device's engine preempts (nothing moves)."""

    name = "BF"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return best_fit(self, charge, exclude)


class WorstFit(BinPackPolicy):
    """Worst fit at the current size; an overflowing device's engine preempts (nothing moves)."""

    name = "WF"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return worst_fit(self, charge, exclude)


class BestFitRestart(BestFit):
    """Best fit at current size; an overflowing device restarts its newest requests elsewhere."""

    name = "BF-restart"

    def _relieve(self, device: str, moves: list[Move]) -> None:
        self._restart_newest(device, moves)


class WorstFitRestart(WorstFit):
    """Worst fit at current size; an overflowing device restarts its newest requests elsewhere."""

    name = "WF-restart"

    def _relieve(self, device: str, moves: list[Move]) -> None:
        self._restart_newest(device, moves)


class _Reserving(BinPackPolicy):
    """Admission reserves the request's final KV footprint (hindsight); the device never overflows, never migrates."""

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
                             "at admission (the reserving arms do not migrate: give its final size)")
        return charge


class BestFitReserve(_Reserving):
    name = "BF-reserve"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return best_fit(self, charge, exclude)


class WorstFitReserve(_Reserving):
    name = "WF-reserve"

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return worst_fit(self, charge, exclude)


BASELINES: dict[str, type[BinPackPolicy]] = {
    "BF": BestFit, "WF": WorstFit, "LB": LoadBalance, "BF-reserve": BestFitReserve, "WF-reserve": WorstFitReserve,
    "BF-restart": BestFitRestart, "WF-restart": WorstFitRestart, "LB-open": LoadBalanceOpen}
# the paper's baselines, which the summary line compares MELL against
PAPER_BASELINES = ("BF", "WF", "LB")
RESERVING = ("BF-reserve", "WF-reserve")  # hindsight arms: the final size reserved at admission
