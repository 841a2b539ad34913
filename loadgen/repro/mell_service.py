"""MELL's comparison at equal service: the GPUs each arm needs to meet one stated SLO.

"GPUs needed" for an arm = the smallest fixed pool of N GPUs (the policy gets gpu-0..gpu-N-1; an
arrival that fits on none waits, a growth that fits nowhere is preempted by the device's engine:
loadgen/sim/kv_packing_fleet.py `pool`) on which the arm meets the SLO:

    P99 over requests of the TTFT added (waiting for memory, re-prefills before the first token)
        <= slo.ttft_s, and
    P99 over requests of the TPOT added (preemptions, migration stalls, re-prefills after it, per
        later token) <= slo.tpot_step_share x the testbed's decode step.

A search over N, as the economy's GPU sweep searches its pool: an arm that misses the SLO with GPUs
opened on demand (unbounded) misses it at every pool (more GPUs change nothing for a policy that opens
them on demand) and needs "none": its row is "latency for GPUs" (what it pays for the GPUs it uses).
Otherwise a bisection, bracketed from the L2 bound: the bound is tried first (the answers sit within a
few GPUs of it), then steps of 1, 2, 4, ... GPUs away from it (down while the SLO is met, up while it is
not) until the answer is bracketed, then the bracket is halved. A run on a pool stops as soon as its
outcome is certain (`Slo.misses_to_fail`): once so many requests are past the TTFT target, or past the
TPOT target, that the P99 cannot meet it whatever happens next (delays only grow), so a failing pool
costs little and the answer is the one the whole run would give.

Monotone? Only up to the noise of one run: a larger pool gives the placement other GPUs (worst fit and
ours spread arrivals over the pool), so the SLO is not strictly monotone in N. The bisection therefore
always ends with its neighbour checked: N meets the SLO and N - 1 was run and misses it (`tried`); a pool
below N - 1 that would meet it again is not looked for. `Needed.runs` is the pools run.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from loadgen.sim.kv_packing_fleet_state import FleetResult


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0  # P99 of the TTFT added, seconds
    tpot_step_share: float = 0.25  # P99 of the TPOT added per token, as a share of the decode step
    percentile: float = 99.0

    def tpot_s(self, decode_step_s: float) -> float:
        return self.tpot_step_share * decode_step_s

    def late_allowed(self, requests: int) -> int:
        """Requests that may miss a target with the P99 still met (a nearest-rank reading, for reports)."""
        return int((100.0 - self.percentile) / 100.0 * requests)

    def misses_to_fail(self, requests: int) -> int:
        """The fewest requests past a target (TTFT or TPOT added) that make its percentile miss it for certain:
        numpy's linear percentile of n values lies between the sorted values at floor(h) and floor(h) + 1,
        h = q (n - 1); it is past the target once the value at floor(h) is, i.e. once n - floor(h) values are
        (`meets` gives the same answer on the whole run)."""
        if requests <= 0:
            return 1
        h = Fraction(str(self.percentile)) / 100 * (requests - 1)
        return requests - math.floor(h)

    def describe(self, decode_step_s: float) -> str:
        return (f"P{self.percentile:g} TTFT added <= {self.ttft_s:g} s and P{self.percentile:g} TPOT added <= "
                f"{1000 * self.tpot_s(decode_step_s):.1f} ms per token ({self.tpot_step_share:g} x the "
                f"{1000 * decode_step_s:.1f} ms decode step)")


def ttft_p(result: FleetResult, slo: Slo) -> float:
    return float(np.percentile(result.ttft_delay, slo.percentile)) if result.ttft_delay is not None else 0.0


def tpot_p(result: FleetResult, slo: Slo) -> float:
    return float(np.percentile(result.tpot_delay, slo.percentile)) if result.tpot_delay is not None else 0.0


def meets(result: FleetResult, slo: Slo, decode_step_s: float) -> bool:
    if getattr(result, "aborted", False):
        return False
    return ttft_p(result, slo) <= slo.ttft_s and tpot_p(result, slo) <= slo.tpot_s(decode_step_s)


@dataclass
class Needed:
    """An arm's GPUs at the SLO: `gpus` (None: no pool meets it) and the pools tried (N -> met)."""

    gpus: int | None
    tried: dict[int, bool]
    result: FleetResult | None = None  # the run at `gpus`

    @property
    def runs(self) -> int:
        return len(self.tried)


def gpus_needed_at_slo(run_at: Callable[[int], FleetResult], unbounded: FleetResult, start: int, slo: Slo,
                       decode_step_s: float) -> Needed:
    """The smallest pool N at which `run_at(N)` meets the SLO: a bisection bracketed by steps of 1, 2, 4, ...
    from `start` (the L2 bound), ending with N met and N - 1 missed (module docstring)."""
    tried: dict[int, bool] = {}
    if not meets(unbounded, slo, decode_step_s):
        return Needed(None, tried)
    top = 2 * max(1, unbounded.peak_physical()) + 2
    results: dict[int, FleetResult] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            results[n] = run_at(n)
            tried[n] = meets(results[n], slo, decode_step_s)
        return tried[n]

    n = max(1, min(start, unbounded.peak_physical()))
    step = 1
    if ok(n):  # bracket downwards: hi met, lo missed (0: nothing below 1)
        hi, lo = n, 0
        while hi > 1:
            m = max(1, hi - step)
            if not ok(m):
                lo = m
                break
            hi, step = m, 2 * step
    else:
        lo, hi = n, 0
        while lo < top:
            m = min(top, lo + step)
            if ok(m):
                hi = m
                break
            lo, step = m, 2 * step
        if not hi:
            return Needed(None, tried)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return Needed(hi, tried, results[hi])


__all__ = ["Needed", "Slo", "gpus_needed_at_slo", "meets", "tpot_p", "ttft_p"]
