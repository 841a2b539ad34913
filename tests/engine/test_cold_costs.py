"""The engine's measured inputs to the cold-start rule (services/gpu_worker/engine/cold_costs.py)."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine.cold_costs import ColdCostModel


def _model() -> ColdCostModel:
    m = ColdCostModel(cpu_chunk=32)
    for rows in (16, 32):  # CPU-assisted steps: 0.2 s + 1e-4 s per row x rank (rank 64)
        m.observe_step(rows + 8, 0.2 + 1e-4 * rows * 64, cpu_work=rows * 64)
    for tokens in (32, 128):  # device steps: 0.05 s + 1 ms a token
        m.observe_step(tokens, 0.05 + 1e-3 * tokens)
    return m


def test_t_cpu_counts_chunks_until_the_load_lands_then_the_device():
    m = _model()
    step = 0.2 + 1e-4 * 32 * 64  # one 32-token chunk: 0.4048 s
    assert m.prefill_s(96) == pytest.approx(0.05 + 0.096)
    # the load lands within the first assisted step: one chunk on the helpers, 96 tokens on the device
    assert m.cpu_s(128, 64, load_s=0.1) == pytest.approx(step + 0.146)
    # it lands after ~2.5 steps: three chunks, then 32 tokens on the device
    assert m.cpu_s(128, 64, load_s=1.0) == pytest.approx(3 * step + 0.05 + 0.032)
    # never (or unknown): every chunk on the helpers
    assert m.cpu_s(128, 64) == pytest.approx(4 * step)
    assert m.cpu_s(20, 64, load_s=5.0) == pytest.approx(0.2 + 1e-4 * 20 * 64)  # a one-chunk prompt


def test_unmeasured_and_what_is_counted():
    m = ColdCostModel(cpu_chunk=32)
    assert m.cpu_s(128, 64) is None and m.prefill_s(128) is None
    m.observe_step(40, 0.3, cpu_work=32 * 64)  # an assisted step is no P measurement
    assert m.prefill_s(128) is None and m.cpu.n == 1
    m.observe_step(40, 0.3, inline=True)  # nor is a step that copied an adapter inline
    assert m.prefill.n == 0 and m.step_s > 0
