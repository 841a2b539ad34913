"""CaraServe's simulated servers pay for cold adapter loads through the one movement cost model:
the adapter's bytes (rank x Llama-2-7B's q/k/v geometry) over the profile's host (PCIe) link."""
from __future__ import annotations

import pytest

from loadgen.repro.caraserve import ADAPTER_GEOMETRY, LORA_PROFILE
from loadgen.sim.lora_worker import LoraGeometry, LoraSimWorker, adapter_load_times
from loadgen.sim.profile import load_profile
from loadgen.sim.request import SimRequest
from shared.lora_profile_file import load_lora_profile

MIB = 1 << 20


def test_adapter_bytes_come_from_rank_and_the_models_geometry() -> None:
    assert ADAPTER_GEOMETRY.adapter_bytes(64) == 32 * 3 * 2 * 4096 * 64 * 2 == 96 * MIB  # CaraServe §2.3: ~100 MiB
    assert ADAPTER_GEOMETRY.adapter_bytes(8) * 8 == ADAPTER_GEOMETRY.adapter_bytes(64)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        ADAPTER_GEOMETRY.adapter_bytes(0)
    with pytest.raises(ValueError, match="hidden, layers, targets"):
        LoraGeometry(hidden=4096, layers=0, targets=3)


def test_the_profiles_host_link_is_the_a10s_pcie_and_loads_scale_with_rank() -> None:
    costs = load_profile("a10-llama2-7b-lora").movement_costs()
    assert costs.host.bandwidth_bytes_per_s == 3.2e10  # PCIe Gen4 x16 per direction (A10 datasheet)
    load = adapter_load_times(costs, ADAPTER_GEOMETRY, {"a": 64, "b": 8})
    assert load("a") == pytest.approx(costs.host.transfer_s(96 * MIB))
    assert load("b") < load("a")
    with pytest.raises(KeyError, match="no rank"):
        load("unknown")


def _first_step_end(resident: bool) -> tuple[float, LoraSimWorker, float]:
    profile = load_profile("a10-llama2-7b-lora")
    ranks = {"fn-1": 64}
    load = adapter_load_times(profile.movement_costs(), ADAPTER_GEOMETRY, ranks)
    w = LoraSimWorker(0, "w0", "m", profile.worker, profile.step, 0.5,
                      lora=load_lora_profile(LORA_PROFILE).model("segmented"), ranks=ranks, adapter_load_s=load)
    if resident:
        w.adapters["fn-1"] = None
    end = w.enqueue(SimRequest(0, "r", "m", "fn-1", 0.0, 100, 4), 0.0)
    assert end is not None
    return end, w, load("fn-1")


def test_a_cold_adapters_prefill_step_ends_later_by_exactly_its_load_time() -> None:
    warm_end, warm, _ = _first_step_end(resident=True)
    cold_end, cold, load_s = _first_step_end(resident=False)
    assert load_s > 0.003  # 96 MiB at 32 GB/s
    assert cold_end - warm_end == pytest.approx(load_s, abs=1e-12)  # the first token waits for the load
    assert cold.adapter_loads == 1 and cold.adapter_load_total_s == pytest.approx(load_s)
    assert warm.adapter_loads == 0 and warm.adapter_load_total_s == 0.0
    # once resident, the next request for it loads nothing
    cold.complete(cold_end)
    assert cold._use_adapter("fn-1") == 0.0 and cold.adapter_loads == 1
