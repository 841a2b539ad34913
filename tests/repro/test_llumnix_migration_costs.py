"""Llumnix (w/ migration) in the simulator pays Llumnix's costs: multi-stage pre-copy over the KV link,
a stall for the last stage, aborts that move nothing -- and every request still finishes once."""
from __future__ import annotations

import msgspec

from loadgen.repro.kunserve import LAYER_BYTES, NUM_LAYERS, PipelineCost, build_trace
from loadgen.repro.kunserve import SCALES
from loadgen.sim.buddy_cluster import BuddyCluster, ClusterConfig
from loadgen.sim.profile import LinkSpec, load_profile
from shared.profiles import load_pipeline_profile


def run(kv_bandwidth: float):
    cfg = SCALES["tiny"]
    profile = load_profile("a800-qwen2.5-14b")
    links = [LinkSpec(name="rdma", latency_s=1e-5, bandwidth_bytes_per_s=kv_bandwidth),
             *[l for l in profile.links if l.name != "rdma"]]
    profile = msgspec.structs.replace(profile, links=links,
                                      worker=msgspec.structs.replace(profile.worker, kv_blocks=400))
    trace = build_trace(cfg, "agieval-cot", 2.5)
    cluster = BuddyCluster(trace, profile, load_pipeline_profile(), PipelineCost(3.4e-3, 5120 * 2 * 256, NUM_LAYERS),
                           ClusterConfig(system="migration", instances=4), NUM_LAYERS, LAYER_BYTES)
    return cluster.run(), cluster


def test_migrations_over_rdma_move_requests_and_pay_a_stall() -> None:
    reqs, cluster = run(2.5e10)
    m = cluster.migration
    assert m.moved > 0 and m.stall_s > 0
    assert all(r.status == "ok" and r.generated == r.output for r in reqs)
    assert not m.active  # every reservation was released or landed


def test_a_slow_link_makes_every_move_stall_for_seconds_and_releases_its_reservations() -> None:
    # 1 MB/s: the shortest running request (Llumnix's SR choice, <= 16 blocks) goes in one stopped
    # stage and stalls for all of it, 3 MB a block (longer ones would abort: tests/policy/test_movement_costs.py)
    reqs, cluster = run(1e6)
    m = cluster.migration
    assert m.moved > 0 and m.stall_s >= 1.0 * m.moved
    assert all(r.status == "ok" and r.generated == r.output for r in reqs)
    assert all(0 <= e.worker.used for e in cluster.engines.values())
    assert all(e.worker.used == 0 for e in cluster.engines.values())  # nothing left reserved at the end
