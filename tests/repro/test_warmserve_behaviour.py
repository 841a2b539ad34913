"""The fleet simulator's autoscaling and prewarming on toy traces (loadgen/sim/fleet*.py).

Two GPUs, two 7B models, the public code's autoscaler (shared/policy/autoscaler.py). Model a fills
both GPUs, then its load drops and model b's rises, as the forecasts say. One of a's instances is
stopped while still draining; with proactive prewarming b's weights load into its KV surplus (Eq. 1)
and b starts on them when the GPU is released (a hit); without, b's first start there is cold.
"""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from loadgen.sim.fleet import FleetResult, FleetSim
from loadgen.sim.fleet_profile import load_fleet_profile
from loadgen.sim.fleet_state import FleetSystem
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord
from shared.policy.warmserve_predictor import LoadForecast


def toy_profile(on_disk: bool = False):
    base = load_fleet_profile("warmserve-h800-llama2")
    if on_disk:
        base = msgspec.structs.replace(base, startup=msgspec.structs.replace(base.startup,
                                                                            checkpoints_in_host_memory=False))
    m7 = base.model("llama2-7b-0")
    return msgspec.structs.replace(base, servers=1, gpus_per_server=2, models=[
        msgspec.structs.replace(m7, name="a"), msgspec.structs.replace(m7, name="b")])


def trace_of(arrivals: list[tuple[str, float]], output: int = 200, duration: float = 150.0) -> Trace:
    arrivals = sorted(arrivals, key=lambda r: r[1])
    records = [TraceRecord(arrival_s=t, model=m, prompt_tokens=200, output_tokens=output, request_id=f"r{i}")
               for i, (m, t) in enumerate(arrivals)]
    return Trace(header=TraceHeader(params=PoissonParams(), num_records=len(records), duration_s=duration),
                 records=records)


def shift_trace() -> Trace:
    # a: 10 requests/s of ~4.5 s each (about 45 in the system: both GPUs) until 60 s, then 3/s (one GPU);
    # b: 3/s from 62 s, when a's second instance is still draining
    arrivals = [("a", k / 10) for k in range(600)] + [("a", 60 + k / 3) for k in range(270)]
    arrivals += [("b", 62 + k / 3) for k in range(264)]
    return trace_of(arrivals)


FORECASTS = {"a": [LoadForecast(45, 50)] * 2 + [LoadForecast(14, 16)] * 4,
             "b": [LoadForecast(0, 0)] * 2 + [LoadForecast(14, 16)] * 4}


def toy_run(prewarm: str, *, on_disk: bool = False, keep: bool = True, trace: Trace | None = None
            ) -> tuple[FleetResult, FleetSim]:
    sim = FleetSim(toy_profile(on_disk), trace or shift_trace(), FleetSystem(prewarm, prewarm=prewarm, keep_weights=keep),
                   forecasts=FORECASTS, window_s=30.0, initial={"a": 2})
    return sim.run(), sim


def p99(r: FleetResult) -> float:
    assert not np.isnan(r.ttft).any(), "every request gets its first token"
    return float(np.quantile(r.ttft, 0.99))


def test_proactive_prewarming_beats_no_proactive_on_a_popularity_shift() -> None:
    pro, pro_sim = toy_run("proactive")
    reactive, _ = toy_run("reactive")
    assert pro_sim.proactive >= 1  # b's weights went into a draining instance's KV surplus
    b = {s.source for s in pro.starts if s.model == "b"}
    assert "gpu" in b and pro.hit_origins().get("proactive", 0) >= 1
    assert "host" in {s.source for s in reactive.starts if s.model == "b"}
    assert pro.hit_rate > reactive.hit_rate
    assert p99(pro) <= p99(reactive)


def test_a_cold_start_from_storage_waits_for_the_disk_read_too() -> None:
    host, host_sim = toy_run("none")
    disk, _ = toy_run("none", on_disk=True)
    first_b = next(s for s in host.starts if s.model == "b")
    assert first_b.source == "host"
    disk_b = next(s for s in disk.starts if s.model == "b")
    assert disk_b.source == "storage" and disk_b.at == first_b.at
    weights = host_sim.profile.model("b").weights_bytes
    extra = host_sim.profile.movement_costs().disk.transfer_s(weights)  # storage -> host memory, then as before
    assert disk_b.ready_at - first_b.ready_at == pytest.approx(extra, rel=1e-6)


def test_a_draining_instance_lends_only_its_surplus_above_the_reservation_target() -> None:
    _, sim = toy_run("proactive")
    for inst in (i for v in sim.instances.values() for i in v):
        assert inst.engine.total + inst.kv_lent_blocks == inst.kv_blocks
        assert inst.engine.used <= inst.engine.total


@pytest.mark.parametrize("prewarm", ["none", "reactive", "proactive"])
def test_no_request_is_lost_while_instances_start_and_stop(prewarm: str) -> None:
    r, _ = toy_run(prewarm)
    assert len(r.ttft) == 1134 and not np.isnan(r.ttft).any()
    assert (r.tpot[~np.isnan(r.tpot)] > 0).all()
    # every request that waited for a start points at a start of its own model
    for k in np.flatnonzero(r.delayed_by >= 0):
        assert r.starts[r.delayed_by[k]].model == r.models[r.model[k]]


def step_load(keep: bool = True) -> tuple[FleetResult, FleetSim]:
    # one instance of a; from 10 s, 60 requests of a arrive within 60 ms and more follow (B = 32): above 0.8 x 32
    arrivals = [("a", 10 + k / 1000) for k in range(60)] + [("a", 10.5 + k / 10) for k in range(100)]
    sim = FleetSim(toy_profile(), trace_of(arrivals, output=600, duration=120.0), FleetSystem("s", keep_weights=keep),
                   initial={"a": 1})
    return sim.run(), sim


def test_the_autoscaler_scales_out_within_its_window_and_idles_to_zero() -> None:
    r, sim = step_load()
    first = min(s.at for s in r.starts if s.model == "a")
    assert 10.0 <= first <= 10.0 + sim.system.scaler.window_s  # a direct start or the windowed rule, not later
    # once the load is gone every instance stops (after its protect period) and leaves its weights warm
    assert sim.instances["a"] == [] and len(sim.replicas) == 2
    assert all(r.origin == "kept" for r in sim.replicas)


def test_stopped_instances_free_their_weights_unless_kept() -> None:
    _, kept = step_load()
    _, freed = step_load(keep=False)
    assert kept.replicas and all(r.origin == "kept" for r in kept.replicas)
    assert freed.instances["a"] == [] and freed.replicas == []
    for g in kept.gpus:  # a kept replica is charged to its GPU's memory like any prewarm
        assert g.held_bytes() == kept.profile.weights_per_gpu(kept.models["a"])


def test_a_stopped_instance_is_never_taken_back() -> None:
    r, sim = toy_run("none")
    ids = [s.id for s in r.starts]
    assert len(ids) == len(set(ids))  # every start is a new instance, none an un-stopped one
    assert all(s.source in ("gpu", "partial", "host", "storage") for s in r.starts)
