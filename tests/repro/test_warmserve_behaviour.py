"""WarmServe in the fleet simulator: proactive prewarming on a toy trace whose popularity shifts.

Two GPUs, two 7B models. Model a fills both GPUs, then its load drops and model b's rises,
as the forecasts say. One of a's instances enters its grace period while still draining; with
proactive prewarming b's weights load into its KV surplus (Eq. 1) and b starts on them when
the GPU is released (a hit); without, b's first instance there is a cold start.
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


def toy_run(prewarm: str, on_disk: bool = False) -> tuple[FleetResult, FleetSim]:
    base = load_fleet_profile("warmserve-h800-llama2")
    if on_disk:
        base = msgspec.structs.replace(base, startup=msgspec.structs.replace(base.startup,
                                                                            checkpoints_in_host_memory=False))
    m7 = base.model("llama2-7b-0")
    profile = msgspec.structs.replace(base, servers=1, gpus_per_server=2, models=[
        msgspec.structs.replace(m7, name="a"), msgspec.structs.replace(m7, name="b")])
    arrivals = [("a", k / 5) for k in range(300)] + [("a", 60 + k / 2) for k in range(180)]
    arrivals += [("b", 70 + k / 3) for k in range(240)]
    arrivals.sort(key=lambda r: r[1])
    records = [TraceRecord(arrival_s=t, model=m, prompt_tokens=200, output_tokens=1000, request_id=f"r{i}")
               for i, (m, t) in enumerate(arrivals)]
    trace = Trace(header=TraceHeader(params=PoissonParams(), num_records=len(records), duration_s=150.0),
                  records=records)
    forecasts = {"a": [LoadForecast(50, 55)] * 2 + [LoadForecast(20, 25)] * 4,
                 "b": [LoadForecast(0, 0)] * 2 + [LoadForecast(30, 35)] * 4}
    sim = FleetSim(profile, trace, FleetSystem(prewarm, prewarm=prewarm, keep_alive_s=2.0), forecasts=forecasts,
                   window_s=30.0, initial={"a": 2})
    return sim.run(), sim


def p99(r: FleetResult) -> float:
    assert not np.isnan(r.ttft).any(), "every request gets its first token"
    return float(np.quantile(r.ttft, 0.99))


def test_proactive_prewarming_beats_no_proactive_on_a_popularity_shift() -> None:
    pro, pro_sim = toy_run("proactive")
    reactive, _ = toy_run("reactive")
    assert pro_sim.proactive >= 1  # b's weights went into a draining instance's KV surplus
    assert pro.hit_rate > reactive.hit_rate
    assert pro.starts["hit"] >= 1 and reactive.starts["cold"] >= 1
    assert p99(pro) < p99(reactive)


def test_a_cold_start_from_disk_waits_for_the_disk_read_too() -> None:
    host, host_sim = toy_run("none")
    disk, _ = toy_run("none", on_disk=True)
    assert host.starts["cold"] >= 1 and disk.starts == host.starts
    first_b = int(np.flatnonzero(host.model == host.models.index("b"))[0])
    weights = host_sim.profile.model("b").weights_bytes
    extra = host_sim.profile.movement_costs().disk.transfer_s(weights)  # storage -> host memory, then as before
    assert disk.ttft[first_b] - host.ttft[first_b] == pytest.approx(extra, rel=1e-6)


def test_a_draining_instance_lends_only_its_surplus_above_the_reservation_target() -> None:
    _, sim = toy_run("proactive")
    for inst in (i for v in sim.instances.values() for i in v):
        assert inst.engine.total + inst.kv_lent_blocks == inst.kv_blocks
        assert inst.engine.used <= inst.engine.total


@pytest.mark.parametrize("prewarm", ["none", "reactive", "proactive"])
def test_no_request_is_lost_while_instances_start_and_stop(prewarm: str) -> None:
    r, _ = toy_run(prewarm)
    assert len(r.ttft) == 720 and not np.isnan(r.ttft).any()
    assert (r.tpot[~np.isnan(r.tpot)] > 0).all()
