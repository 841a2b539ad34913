"""The cold-LoRA decision rule (shared/policy/lora_cold_choice.py) on worked examples."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.lora_cold_choice import (ASYNC, CPU_ASSIST, INLINE, PROBE_EVERY, ColdCosts, ColdSituation, LinearFit, LinkRates,
                                            choose, chunk_steps, page_lock_host)

BUSY = ColdSituation(helpers_ready=True, prefilling=True, load_beside=True, in_flight=False, others=8, async_extra_s=0.016)


def test_paper_regime_cpu_assist_beats_the_load():
    # CaraServe's A10: a 96 MiB rank-64 adapter at 6 GB/s is X = 16.8 ms; a 128-token prompt's
    # prefill P = 32 ms; its CPU LoRA part on 8 cores ~ 12 ms. 12 < 16.8 + 32: assist.
    c = choose(ColdCosts(cpu_s=0.012, load_s=0.0168, prefill_s=0.032), BUSY)
    assert c.kind == CPU_ASSIST and "T_cpu 12.0 ms < X 16.8 ms + P 32.0 ms" in c.reason


def test_h200_regime_the_load_wins():
    # docs/gpu.md's H200 run: a 12.6 MB adapter at a pageable 3.4 GB/s is X = 3.7 ms, P ~ 10 ms, a
    # CPU-assisted prefill ~ 90 ms: 90 >= 13.7, the asynchronous load (others run, so not inline).
    c = choose(ColdCosts(cpu_s=0.090, load_s=0.0037, prefill_s=0.010), BUSY)
    assert c.kind == ASYNC and ">=" in c.reason


def test_p_counts_not_only_x():
    # T_cpu 25 ms beats neither X 10 ms alone nor ... but X + P = 10 + 20 = 30 > 25: assist.
    # (The docs' old rule, T_cpu < X, would have said load.)
    assert choose(ColdCosts(0.025, 0.010, 0.020), BUSY).kind == CPU_ASSIST
    assert choose(ColdCosts(0.031, 0.010, 0.020), BUSY).kind == ASYNC
    assert choose(ColdCosts(0.030, 0.010, 0.020), BUSY).kind == ASYNC  # strict: a tie loads


def test_what_assisting_costs_the_others_counts():
    # T_cpu 12 ms < X 16.8 + P 32 alone; with 25 ms of the others' waits on top it loses to the load
    assert choose(ColdCosts(0.012, 0.0168, 0.032, 0.025), BUSY).kind == CPU_ASSIST
    c = choose(ColdCosts(0.012, 0.0168, 0.032, 0.040), BUSY)
    assert c.kind == ASYNC and "T_cpu 12.0 ms + O 40.0 ms >= X 16.8 ms + P 32.0 ms" in c.reason


def test_pinned_link_shrinks_x_and_flips_the_choice():
    # A 96 MiB adapter: pageable 3.4 GB/s -> X = 29.6 ms; page-locked 34 GB/s -> 2.96 ms. P = 10 ms,
    # T_cpu = 20 ms: assist over the pageable link (20 < 39.6), the load over the pinned one (20 >= 12.96).
    rates = LinkRates({"pageable": 3.4e9, "page-locked": 34e9})
    nbytes = 96 << 20
    x_pageable, x_pinned = rates.seconds("pageable", nbytes), rates.seconds("page-locked", nbytes)
    assert x_pageable == pytest.approx(0.0296, abs=1e-4) and x_pinned == pytest.approx(0.00296, abs=1e-5)
    assert choose(ColdCosts(0.020, x_pageable, 0.010), BUSY).kind == CPU_ASSIST
    assert choose(ColdCosts(0.020, x_pinned, 0.010), BUSY).kind == ASYNC


def test_inline_when_nothing_else_runs_or_no_link():
    alone = ColdSituation(True, True, True, in_flight=False, others=0, async_extra_s=0.016)
    assert choose(ColdCosts(0.090, 0.004, 0.010), alone).kind == INLINE  # no one to stall
    # a tiny load beside 2 others: 0.1 ms x 2 <= async's measured 16 ms beyond X: inline; 10 ms x 2 > 16 ms: async
    few = ColdSituation(False, True, True, in_flight=False, others=2, async_extra_s=0.016)
    assert choose(ColdCosts(None, 0.0001, 0.010), few).kind == INLINE
    assert choose(ColdCosts(None, 0.010, 0.010), few).kind == ASYNC
    # in flight: never restarted inline
    flying = ColdSituation(False, True, True, in_flight=True, others=0, async_extra_s=0.016)
    assert choose(ColdCosts(None, 0.001, 0.010), flying).kind == ASYNC
    # a CPU worker without pacing: the copy is a memory copy in the step
    nolink = ColdSituation(True, True, False, in_flight=False, others=8, async_extra_s=0.016)
    c = choose(ColdCosts(0.001, 0.0, 0.010), nolink)
    assert c.kind == INLINE and "no link" in c.reason


def test_decoding_never_assists_and_unmeasured_t_cpu_is_measured():
    decoding = ColdSituation(True, False, True, in_flight=False, others=8, async_extra_s=0.016)
    assert choose(ColdCosts(0.001, 0.050, 0.010), decoding).kind == ASYNC
    assert choose(ColdCosts(None, 0.050, 0.010), decoding).kind == ASYNC
    c = choose(ColdCosts(None, 0.050, None), BUSY)
    assert c.kind == CPU_ASSIST and "not measured" in c.reason
    # a stale T_cpu that says "load" is re-measured once every PROBE_EVERY cold decisions
    slow = ColdCosts(0.090, 0.004, 0.010)
    assert choose(slow, dataclasses.replace(BUSY, since_cpu=PROBE_EVERY - 1)).kind == ASYNC
    c = choose(slow, dataclasses.replace(BUSY, since_cpu=PROBE_EVERY))
    assert c.kind == CPU_ASSIST and "re-measuring" in c.reason


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        choose(ColdCosts(0.01, -1.0, 0.01), BUSY)
    with pytest.raises(ValueError):
        LinkRates({"fast": 1e9})
    with pytest.raises(ValueError):
        LinkRates({"pageable": 0.0})
    with pytest.raises(ValueError):
        LinearFit().add(-1, 2)


def test_chunk_steps():
    assert chunk_steps(100, 32) == 4 and chunk_steps(32, 32) == 1 and chunk_steps(33, 32) == 2
    assert chunk_steps(500, 0) == 1


def test_linear_fit_recovers_a_line_and_follows_a_change():
    f = LinearFit()
    assert f.predict(10) is None
    f.add(100, 0.5)  # one point: through the origin
    assert f.predict(200) == pytest.approx(1.0)
    f = LinearFit()
    for x in (50, 100, 200, 400, 50, 300):
        f.add(x, 0.002 + 1e-5 * x)
    a, b = f.coefficients()
    assert a == pytest.approx(0.002, rel=1e-3) and b == pytest.approx(1e-5, rel=1e-3)
    for _ in range(60):  # the machine got twice as slow: the decayed fit follows
        for x in (50, 400):
            f.add(x, 2 * (0.002 + 1e-5 * x))
    assert f.predict(400) == pytest.approx(2 * (0.002 + 4e-3), rel=0.02)


def test_link_rates_measured_and_borrowed():
    r = LinkRates()
    assert r.seconds("pageable", 1 << 20) == 0.0  # unknown: an unpaced memory copy
    r.add("pageable", 34_000_000, 0.01)  # 3.4 GB/s measured
    assert r.rate("pageable") == pytest.approx(3.4e9)
    assert r.rate("page-locked") == pytest.approx(3.4e9)  # borrowed until measured
    r.add("page-locked", 34_000_000, 0.001)
    assert r.rate("page-locked") == pytest.approx(3.4e10) and r.rate("pageable") == pytest.approx(3.4e9)


def test_page_lock_only_on_a_cuda_engine_with_cuda():
    assert page_lock_host("cuda", True)
    assert not page_lock_host("cuda", False)
    assert not page_lock_host("cpu", True)
    assert not page_lock_host("cuda", True, setting=False)


_seconds = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(cpu=st.one_of(st.none(), _seconds), load=_seconds, pre=st.one_of(st.none(), _seconds), o=_seconds,
       ready=st.booleans(), prefilling=st.booleans(), beside=st.booleans(), flying=st.booleans(),
       others=st.integers(0, 64), extra=_seconds, since=st.integers(0, 2 * PROBE_EVERY))
def test_the_choice_is_the_rules_inequalities_on_the_measured_inputs(cpu, load, pre, o, ready, prefilling, beside,
                                                                     flying, others, extra, since):
    at = ColdSituation(ready, prefilling, beside, in_flight=flying, others=others, async_extra_s=extra, since_cpu=since)
    kind = choose(ColdCosts(cpu, load, pre, o), at).kind
    can_assist = ready and prefilling and beside
    assists = can_assist and (cpu is None or since >= PROBE_EVERY or cpu + o < load + (pre or 0.0))
    if assists:
        assert kind == CPU_ASSIST
    elif not beside:
        assert kind == INLINE  # nothing to hide the copy behind
    elif not flying and load * others <= extra:
        assert kind == INLINE  # stalling the others costs less than async's measured wait beyond X
    else:
        assert kind == ASYNC
