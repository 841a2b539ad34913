"""The simulator routes with the live LoRA policies and shows them the ranks of each batch."""
from __future__ import annotations

from collections.abc import Sequence

from loadgen.sim.profile import CostProfile, WorkerSpec
from loadgen.sim.run import simulate
from loadgen.sim.simulator import Simulator
from loadgen.traces.generate import generate
from loadgen.traces.schema import MAFParams
from shared.policy.lora_routing import RoutingOptions
from shared.policy.routing import InstanceView, RequestView
from shared.policy.routing_policies import make_policy

TRACE = generate(MAFParams(seed=3, duration_s=20.0, rate=8.0, adapters=40, ranks=[8, 64], base_fraction=0.2))
PROFILE = CostProfile(worker=WorkerSpec(max_batch=8, max_resident_adapters=4))


class Spy:
    """Rank-aware, recording what it was shown."""

    name = "spy"

    def __init__(self) -> None:
        self.inner = make_policy("rank-aware", options=RoutingOptions(kernel="padded", slo_factor=1.5))
        self.seen: list[tuple[RequestView, list[InstanceView]]] = []

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        self.seen.append((request, list(instances)))
        return self.inner.choose(request, instances, now)


def test_views_carry_the_batch_ranks_and_requests_their_rank() -> None:
    ranks = {a.name: a.rank for a in TRACE.header.adapters}
    spy = Spy()
    result = Simulator(TRACE, PROFILE, 3, spy, check_invariants=True).run()
    assert result.stats.finishes == len(TRACE.records)
    assert all(r.status == "ok" for r in result.records)
    busy = 0
    for request, views in spy.seen:
        assert request.adapter_rank == ranks.get(request.adapter, 0)  # type: ignore[arg-type]
        for view in views:
            assert len(view.running_ranks) == view.running_requests
            assert len(view.waiting_ranks) == view.waiting_requests
            assert set(view.running_ranks) | set(view.waiting_ranks) <= {0, 8, 64}
            busy += bool(view.running_ranks)
    assert busy > 0  # the trace is loaded enough that batches were seen


def test_every_lora_policy_serves_the_whole_trace() -> None:
    for name in ("rank-aware", "most-idle", "first-fit", "random"):
        result = simulate(TRACE, PROFILE, 3, name, seed=1, options=RoutingOptions(kernel="segmented"))
        assert [r.status for r in result.records].count("ok") == len(TRACE.records), name
