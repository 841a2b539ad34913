"""CaraServe's cold-start experiment in the simulator (loadgen/repro/caraserve_cold.py): the five modes'
semantics on hand-made traces, the sources of the costs, and the paper-scale ordering."""
from __future__ import annotations

import numpy as np
import pytest

from loadgen.repro.caraserve import ADAPTER_GEOMETRY
from loadgen.repro.caraserve_cold import (COLD_WORKLOADS, MODES, PAPER_EFFECTIVE_BPS, ColdRequest, build_requests,
                                          cold_keys, cpu_lora_flop, run_cold, setup, simulate)

MIB = 1 << 20


def test_costs_come_from_sources():
    s = setup()
    assert s.adapter_bytes[64] == 96 * MIB and s.adapter_bytes[32] * 2 == s.adapter_bytes[64]
    assert s.load_s[64] == pytest.approx(1e-5 + 96 * MIB / 3.2e10)  # the profile's PCIe link (A10 datasheet)
    paper = setup(PAPER_EFFECTIVE_BPS)
    assert paper.load_s[64] == pytest.approx(0.0167 + 1e-5)  # Fig. 3-Left's fit: 16.7 ms at rank 64
    # FLOP per token and rank equals the adapter's bytes per rank: the rank cancels in CPU vs load
    assert cpu_lora_flop(1, 1) == ADAPTER_GEOMETRY.adapter_bytes(1)


def _one(mode, reqs, **kw):
    return simulate(mode, reqs, setup(**kw))


def test_ondemand_stalls_the_batch_async_only_the_cold_request():
    # a long-running warm... every request is cold here; the second arrives while the first decodes
    reqs = [ColdRequest(0.0, 16, 40, 0, 64), ColdRequest(0.2, 16, 40, 1, 64)]
    s = setup(PAPER_EFFECTIVE_BPS)
    cached, ondemand, asyn = (simulate(m, reqs, s) for m in ("cached", "ondemand", "async"))
    load = s.load_s[64]
    assert ondemand.ttft[0] == pytest.approx(cached.ttft[0] + load)  # its prefill iteration waited for the load
    assert asyn.ttft[0] == pytest.approx(cached.ttft[0] + load)  # nothing to overlap with: it waits too
    # request 0 was decoding when request 1's load ran inside the prefill iteration: it slowed down
    assert ondemand.tpot[0] > cached.tpot[0] and asyn.tpot[0] == pytest.approx(cached.tpot[0], rel=0.02)
    assert ondemand.loads == asyn.loads == 2 and cached.loads == 0


def test_caraserve_hides_the_load_while_its_cpu_part_fits_under_the_gpu_iteration():
    reqs = [ColdRequest(0.0, 16, 8, 0, 64)]
    s = setup(PAPER_EFFECTIVE_BPS)
    cached, cara = simulate("cached", reqs, s), simulate("caraserve", reqs, s)
    assert cara.ttft[0] == pytest.approx(cached.ttft[0])  # 16 tokens on 8 cores: ~7 ms < the 31.8 ms iteration
    long = [ColdRequest(0.0, 2000, 8, 0, 64)]
    slow = setup(PAPER_EFFECTIVE_BPS, cpu_flops_per_core=1e9, cpu_cores=1)
    c2, k2 = simulate("cached", long, slow), simulate("caraserve", long, slow)
    # the CPU part is far longer than the load: the GPU takes over when it lands
    assert k2.ttft[0] == pytest.approx(c2.ttft[0] + slow.load_s[64], rel=1e-6)


def test_maf_workloads_reuse_popular_adapters():
    reqs = build_requests(COLD_WORKLOADS["maf-128"], 120, 0)
    assert len({r.adapter for r in reqs}) < len(reqs) / 2
    res = simulate("ondemand", reqs, setup())
    assert res.loads == len({r.adapter for r in reqs})  # each loaded once: they stay resident
    synthetic = build_requests(COLD_WORKLOADS["synthetic-r64"], 10, 0)
    assert len({r.adapter for r in synthetic}) == len(synthetic) and {r.rank for r in synthetic} == {64}
    with pytest.raises(ValueError, match="unknown cold-start mode"):
        simulate("lazy", synthetic, setup())


def test_paper_workload_caraserve_well_below_a_third_of_ondemand():
    runs = run_cold(("synthetic-r64",), 120, 0, links=("pcie-peak", "paper-effective"))
    for run in runs:
        assert set(run.results) == set(MODES)
        assert run.overhead("caraserve") < run.overhead("ondemand") / 3
        assert np.isfinite(run.results["caraserve"].ttft).all()
    assert cold_keys(runs).startswith("cold_ttft_overhead_caraserve=")
