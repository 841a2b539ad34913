"""The admission gate by policy (shared/policy/admission.py), rank-aware's price for a cold load,
and the simulator routing through the same gate (pure)."""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from loadgen.sim.profile import CostProfile, WorkerSpec
from loadgen.sim.simulator import Simulator
from loadgen.traces.generate import generate
from loadgen.traces.schema import MAFParams
from shared.config import parse_config
from shared.lora_profile_file import routing_options
from shared.policy.admission import adapter_gate, serving, with_room
from shared.policy.lora_perf_model import PAPER_PROFILE
from shared.policy.lora_routing import RankAware
from shared.policy.routing import InstanceView, RequestView
from shared.policy.routing_policies import make_policy


def inst(iid: str, *, running: tuple[int, ...] = (), resident: frozenset[str] = frozenset(),
         room: int | None = None) -> InstanceView:
    return InstanceView(instance_id=iid, worker_id=f"w-{iid}", model="m", kv_blocks_total=100,
                        running_requests=len(running), running_ranks=running, resident_adapters=resident,
                        adapter_room_bytes=room, adapters=frozenset({"a"}), max_batch=64)


def req(nbytes: int = 100 << 20, rank: int = 16) -> RequestView:
    return RequestView(request_id="r", model="m", prompt_tokens=16, max_tokens=64, adapter="a", adapter_rank=rank,
                       adapter_bytes=nbytes)


FLEET = [inst("warm", running=(64,) * 20, resident=frozenset({"a"})), inst("cold", room=1 << 30),
         inst("full", room=1 << 20)]


def test_gate_by_policy() -> None:
    for name in ("rank-aware", "most-idle", "first-fit", "random"):
        gate = adapter_gate(make_policy(name))
        assert gate == "hostable", name
        assert [i.instance_id for i in serving(req(), FLEET, gate)] == ["warm", "cold"], name  # "full": 1 MiB < 100
    for name in ("least-load", "mell"):
        gate = adapter_gate(make_policy(name))
        assert gate == "resident_first", name
        assert [i.instance_id for i in with_room(req(), FLEET, gate)] == ["warm"], name  # today's behaviour
    cold_only = FLEET[1:]
    assert [i.instance_id for i in serving(req(), cold_only)] == ["cold", "full"]  # nobody has it: anyone may try


def test_rank_aware_prices_a_cold_load_by_bytes_over_bandwidth() -> None:
    model = PAPER_PROFILE.model("segmented")
    fast = RankAware(model, load_bandwidth={"w-cold": 16e9})  # 100 MiB in 6.6 ms: the cold idle instance wins
    assert fast.load_s(req(), FLEET[1]) == pytest.approx((100 << 20) / 16e9)
    assert fast.load_s(req(), FLEET[0]) == 0.0  # resident
    assert fast.choose(req(), FLEET, 0.0) == "cold"
    slow = RankAware(model, load_bandwidth={"w-cold": 1e7})  # 10.5 s to load: the warm busy one wins
    assert slow.choose(req(), FLEET, 0.0) == "warm"
    cost_fast, cost_slow = fast.cost(req(), FLEET[1]), slow.cost(req(), FLEET[1])
    assert cost_slow.own - cost_fast.own == pytest.approx(((100 << 20) / 1e7 - (100 << 20) / 16e9) / 128)
    # no bandwidth for that worker: the profile's default, else the fixed cold_load_s
    assert RankAware(model, default_load_bandwidth=1e7).load_s(req(), FLEET[1]) == pytest.approx((100 << 20) / 1e7)
    assert RankAware(model, cold_load_s=2.0).load_s(req(), FLEET[1]) == 2.0
    assert RankAware(model, default_load_bandwidth=1e7, cold_load_s=2.0).load_s(req(nbytes=0), FLEET[1]) == 2.0
    with pytest.raises(ValueError, match="bandwidth"):
        RankAware(model, load_bandwidth={"w": 0.0})


def test_routing_options_take_the_workers_load_bandwidth_from_the_config() -> None:
    cfg = parse_config("""
[[models]]
name = "m"
path = "/m"

[[workers]]
id = "w0"
memory = "1GiB"
lora_load_bandwidth = "16MB/s"

[[workers]]
id = "w1"
memory = "1GiB"
""")
    options = routing_options(cfg, PAPER_PROFILE)
    assert options.load_bandwidth == {"w0": 16e6} and options.default_load_bandwidth is None
    policy = make_policy("rank-aware", options=options)
    assert isinstance(policy, RankAware) and policy.load_bandwidth == {"w0": 16e6}


class Spy:
    """Records the instances the simulator offers; picks the first."""

    def __init__(self, gate: str) -> None:
        self.name, self.adapter_gate = "spy", gate
        self.offered: list[tuple[RequestView, list[InstanceView]]] = []

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        self.offered.append((request, list(instances)))
        return instances[0].instance_id if instances else None


def test_the_simulator_routes_through_the_same_gate() -> None:
    trace = generate(MAFParams(seed=2, duration_s=10.0, rate=6.0, adapters=6, ranks=[8, 64], base_fraction=0.0))
    profile = CostProfile(worker=WorkerSpec(max_batch=8, max_resident_adapters=2))
    narrowed = 0
    for gate in ("resident_first", "hostable"):
        spy = Spy(gate)
        Simulator(trace, profile, 3, spy).run()
        for request, offered in spy.offered:
            assert offered  # every worker serves the model
            resident = [v for v in offered if request.adapter in v.resident_adapters]
            if gate == "resident_first" and resident:
                assert offered == resident
                narrowed += len(offered) < 3
            if gate == "hostable":
                assert len(offered) == 3  # sim instances report no room: unknown, so every one may load it
    assert narrowed > 0  # the trace does hit adapters resident on some workers only


def test_an_slo_relative_to_a_nonpositive_unloaded_step_is_refused() -> None:
    from shared.policy.lora_perf_model import LinearFit, LoraPerfModel

    bad = LoraPerfModel(kernel="padded", decode=LinearFit(alpha_s=1e-5, gamma_s=1e-3, beta_s=-2e-3),
                        prefill=LinearFit(alpha_s=0.0, gamma_s=1e-4))
    with pytest.raises(ValueError, match="unloaded decode step"):
        RankAware(bad, slo_factor=1.5)
    assert RankAware(bad, tpot_slo_s=0.05).slo_s == 0.05  # an absolute SLO does not depend on it
