"""The engine's measured inputs to the cold-start rule (services/gpu_worker/engine/cold_costs.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.engine.cold_costs import ColdCostModel


def _model() -> ColdCostModel:
    m = ColdCostModel(cpu_chunk=32)
    for rows in (16, 32):  # CPU-assisted steps: 0.2 s + 1e-4 s per row x rank (rank 64)
        m.observe_step(rows + 8, 0.2 + 1e-4 * rows * 64, cpu_work=rows * 64)
    for tokens in (32, 128):  # device steps: 0.05 s + 1 ms a token
        m.observe_step(tokens, 0.05 + 1e-3 * tokens)
    return m


def test_t_cpu_is_the_assisted_path_until_the_load_lands_then_the_device_inside_the_step():
    m = _model()
    p128 = 0.05 + 0.128
    assert m.prefill_s(128) == pytest.approx(p128)
    whole = 0.2 + 1e-4 * 128 * 64  # the whole prompt in one assisted step: 1.0192 s
    step = 0.2 + 1e-4 * 32 * 64  # one 32-token chunk: 0.4048 s
    # the load lands within the whole prompt's assisted step: left whole, the device takes over at 0.1 s
    # with 0.1 / whole of the prompt through, and does the rest (its share of P) in the same step
    assert m.cpu_s(128, 64, load_s=0.1) == pytest.approx(0.1 + (1 - 0.1 / whole) * p128)
    # it lands after 1.5 s: in chunks of 32, 1.5 / step chunks through, the device does the rest
    assert m.cpu_s(128, 64, load_s=1.5) == pytest.approx(1.5 + (1 - 32 * 1.5 / step / 128) * p128)
    # never (or unknown), or after every chunk is through: every chunk on the helpers
    assert m.cpu_s(128, 64) == pytest.approx(4 * step)
    assert m.cpu_s(128, 64, load_s=2.0) == pytest.approx(4 * step)
    assert m.cpu_s(20, 64, load_s=5.0) == pytest.approx(0.2 + 1e-4 * 20 * 64)  # a one-chunk prompt


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(1, 2048), rank=st.integers(1, 128), chunk=st.sampled_from([0, 16, 32, 128]),
       load=st.floats(0.0, 10.0), a=st.floats(0.0, 0.5), b=st.floats(1e-7, 1e-3))
def test_t_cpu_never_loses_to_x_plus_p_while_the_load_is_still_on_its_way(tokens, rank, chunk, load, a, b):
    # The rule's inequality under the takeover inside a step: when the load lands before the helpers'
    # path is through the prompt, T_cpu = X + the device's share of P left; after, that path alone.
    m = ColdCostModel(cpu_chunk=chunk)
    for rows in (8, 64):
        m.observe_step(rows, a + b * rows * 64, cpu_work=rows * 64)
    for n in (32, 128):
        m.observe_step(n, 0.01 + 1e-4 * n)
    on_cpu = m.cpu_s(tokens, rank)  # no load landing: every chunk on the helpers
    t = m.cpu_s(tokens, rank, load_s=load)
    p = m.prefill_s(tokens)
    # so the rule assists whenever its helpers are ready, P is measured and there is a load to hide (X > 0)
    assert t <= load + p + 1e-12 and (load < 1e-9 or t < load + p)
    assert t >= load or t == pytest.approx(on_cpu)  # done before the load lands only on the helpers alone


def test_what_assisting_costs_the_others():
    m = _model()  # assisted steps 0.2 s + 1e-4 s per row x rank; the mean step as measured
    mean = m.step_s
    step = 0.2 + 1e-4 * 32 * 64  # a 32-token chunk's assisted step (the load lands after the whole prompt's)
    assert m.others_s(128, 64, load_s=0.1, others=0) == 0.0
    whole = 0.2 + 1e-4 * 128 * 64  # left whole: the load lands within it, the others wait 0.1 s at that rate
    assert m.others_s(128, 64, load_s=0.1, others=3) == pytest.approx(3 * 0.1 * (1 - mean / whole))
    # the load after every chunk is through: the others are slowed for the four assisted steps only
    assert m.others_s(128, 64, load_s=9.0, others=2) == pytest.approx(2 * 4 * step * (1 - mean / step))
    assert ColdCostModel(cpu_chunk=32).others_s(128, 64, load_s=1.0, others=4) == 0.0  # unmeasured


def test_async_wait_beyond_x_is_measured_else_half_a_step():
    m = ColdCostModel(cpu_chunk=32)
    assert m.async_extra_s() == 0.0
    m.observe_step(16, 0.040)
    assert m.async_extra_s() == pytest.approx(0.020)  # the prior: half the measured step
    m.observe_async_wait(0.004)
    assert m.async_extra_s() == pytest.approx(0.004)  # measured: it replaces the prior
    m.observe_async_wait(0.014)
    assert m.async_extra_s() == pytest.approx(0.8 * 0.004 + 0.2 * 0.014)
    with pytest.raises(ValueError):
        m.observe_async_wait(-1.0)


def test_unmeasured_and_what_is_counted():
    m = ColdCostModel(cpu_chunk=32)
    assert m.cpu_s(128, 64) is None and m.prefill_s(128) is None
    m.observe_step(40, 0.3, cpu_work=32 * 64)  # an assisted step is no P measurement
    assert m.prefill_s(128) is None and m.cpu.n == 1
    m.observe_step(40, 0.3, inline=True)  # nor is a step that copied an adapter inline
    assert m.prefill.n == 0 and m.step_s > 0
