"""Equal service for `tidal repro mell`: fixed pools in the fleet (an arrival that fits nowhere waits),
the Eq. 2 arms (LB-open, ours) on the case where the waiting arms preempt, and the pool search
(loadgen/repro/mell_service.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from repro.test_kv_packing_fleet import two_growing

from loadgen.repro.mell_service import Slo, gpus_needed_at_slo, meets
from loadgen.sim.kv_packing import build_schedule
from loadgen.sim.kv_packing_fleet import pool_devices, run_fleet
from loadgen.sim.kv_packing_fleet_state import FleetResult
from shared.policy.binpack_lb import LoadBalanceOpen
from shared.policy.mell import MellScheduler
from shared.policy.packer import RepackFit


def test_eq2_arms_open_a_gpu_where_the_waiting_arms_preempt() -> None:
    """two_growing: at 21 s the two requests need 102 tokens of a 100-token GPU. LB-open (no free pair to
    relieve it) and ours move one to a GPU they open; nobody waits."""
    for policy in (LoadBalanceOpen(100), RepackFit(100)):
        r = run_fleet(two_growing(), policy, policy.name, mode="tokens")
        assert r.peak_devices() == 2 and r.preemptions == 0 and r.moves == 1, policy.name


def test_a_full_pool_makes_an_arrival_wait_and_charges_its_ttft() -> None:
    """Two 60-token requests (prompt 50, 10 out at 1 s a token) on a pool of one 100-token GPU: the second
    waits until the first leaves; with a pool of two, nobody waits."""
    s = build_schedule(np.array([0.5, 0.6]), np.array([50, 50]), np.array([10, 10]), capacity=100, bytes_per_token=1,
                       granule_tokens=10, epoch_s=1.0, prefill_s_per_token=0.0, decode_step_s=1.0)
    for policy in (MellScheduler(100, pool_devices(1)), RepackFit(100, pool_devices(1))):
        r = run_fleet(s, policy, "one", mode="tokens", pool=1)
        assert r.peak_devices() == 1 and r.refused > 0 and r.ttft_delay[0] == 0
        assert r.ttft_delay[1] >= 9  # it waited for r0's ten tokens
        assert r.tpot_delay.max() == 0 and r.preemptions == 0
    r = run_fleet(s, MellScheduler(100, pool_devices(2)), "two", mode="tokens", pool=2)
    assert r.refused == 0 and not r.ttft_delay.any() and r.peak_devices() == 2


def _fake(gpus_ok_from: int, peak: int = 10) -> tuple:
    def result(ok: bool) -> FleetResult:
        ttft = np.zeros(100) if ok else np.full(100, 5.0)
        return FleetResult(policy="x", active=np.array([peak]), moves=0, moves_before_dedup=0, max_moves_per_op=-1,
                           overcommitted_epochs=0, wall_s=0.0, ttft_delay=ttft, tpot_delay=np.zeros(100),
                           active_physical=np.array([peak]))
    calls: list[int] = []

    def run_at(n: int) -> FleetResult:
        calls.append(n)
        return result(n >= gpus_ok_from)
    return run_at, result(True), calls


@pytest.mark.parametrize("answer,start", [(7, 7), (5, 7), (9, 7), (1, 3)])
def test_the_pool_search_finds_the_smallest_pool_meeting_the_slo(answer: int, start: int) -> None:
    run_at, unbounded, calls = _fake(answer)
    got = gpus_needed_at_slo(run_at, unbounded, start, Slo(), 0.03)
    assert got.gpus == answer and got.tried[answer] and (answer == 1 or got.tried[answer - 1] is False)
    assert len(calls) == len(set(calls)) <= abs(answer - start) + 2


@given(answer=st.integers(1, 60), start=st.integers(1, 60))
def test_the_bisection_finds_any_threshold_in_logarithmically_many_runs(answer: int, start: int) -> None:
    """A monotone SLO (met from `answer` GPUs up): found exactly, N - 1 run and missed, and far from the start
    in O(log) runs (a linear step would take |answer - start| + 2)."""
    run_at, unbounded, calls = _fake(answer, peak=64)
    got = gpus_needed_at_slo(run_at, unbounded, start, Slo(), 0.03)
    assert got.gpus == answer and (answer == 1 or got.tried[answer - 1] is False)
    assert got.runs == len(calls) == len(set(calls)) <= 2 * int(np.ceil(np.log2(abs(answer - start) + 1))) + 2


@given(met=st.sets(st.integers(1, 30), min_size=1), start=st.integers(1, 30))
def test_on_a_non_monotone_slo_the_answer_meets_it_and_its_neighbour_below_misses(met: set[int], start: int) -> None:
    """Pools that meet the SLO in any pattern (a larger pool may spread worse): whatever the bisection returns
    was run and met it, and the pool one below was run and missed it (the neighbour is always checked)."""
    met = met | {42}  # the top of the search (2 x the on-demand peak of 20 + 2) meets it
    calls: list[int] = []
    meets_at, misses_at = _fake(1, peak=20)[0], _fake(10**6, peak=20)[0]

    def run_at(n: int) -> FleetResult:
        calls.append(n)
        return meets_at(n) if n in met else misses_at(n)

    unbounded = _fake(1, peak=20)[1]
    got = gpus_needed_at_slo(run_at, unbounded, start, Slo(), 0.03)
    assert got.gpus is not None and got.tried[got.gpus] and got.gpus in met
    assert got.gpus == 1 or got.tried[got.gpus - 1] is False


def test_an_arm_that_misses_the_slo_on_demand_needs_none() -> None:
    run_at, _, calls = _fake(1)
    late = FleetResult(policy="x", active=np.array([3]), moves=0, moves_before_dedup=0, max_moves_per_op=-1,
                       overcommitted_epochs=0, wall_s=0.0, ttft_delay=np.zeros(100),
                       tpot_delay=np.full(100, 0.05))  # 50 ms a token over a 30 ms step
    assert not meets(late, Slo(), 0.03)
    got = gpus_needed_at_slo(run_at, late, 3, Slo(), 0.03)
    assert got.gpus is None and calls == []


@given(st.lists(st.floats(0, 10), min_size=1, max_size=400), st.floats(0.1, 9.9))
def test_the_early_stop_count_makes_the_p99_miss_and_one_fewer_may_not(values: list[float], limit: float) -> None:
    """`misses_to_fail(n)` values past a target put numpy's P99 past it whatever the others are; with one fewer
    past it, the P99 can still meet it (so a run stopped at that count answers as the whole run would)."""
    slo, n = Slo(), len(values)
    k = slo.misses_to_fail(n)
    over = np.asarray(values)
    over[:k - 1 if k <= n else n] = limit + 1.0
    if k <= n:
        over[k - 1] = limit + 1e-3
        assert np.percentile(over, slo.percentile) > limit
    low = np.zeros(n)
    low[:k - 1] = limit * (1 + 1e-6)  # k - 1 past it, the rest met
    assert np.percentile(low, slo.percentile) <= limit


def test_a_run_on_a_pool_stops_once_enough_requests_are_past_the_tpot_target() -> None:
    """Many long requests growing on a one-GPU pool: preemptions push their TPOT past the target; the run with
    the stop ends early and misses, as the whole run does."""
    rng = np.random.default_rng(5)
    n = 60
    s = build_schedule(np.sort(rng.uniform(0, 20, n)), rng.integers(5, 20, n), rng.integers(30, 60, n), capacity=300,
                       bytes_per_token=1, granule_tokens=10, epoch_s=1.0, prefill_s_per_token=0.05,
                       decode_step_s=0.1)
    slo = Slo(ttft_s=1e9, tpot_step_share=0.25)
    full = run_fleet(s, RepackFit(300, pool_devices(1)), "full", mode="tokens", pool=1)
    assert not meets(full, slo, 0.1) and not full.aborted
    stopped = run_fleet(s, RepackFit(300, pool_devices(1)), "stop", mode="tokens", pool=1,
                        abort_late=(slo.ttft_s, slo.tpot_s(0.1), slo.misses_to_fail(n)))
    assert stopped.aborted and not meets(stopped, slo, 0.1)
    assert len(stopped.active) < len(full.active)
