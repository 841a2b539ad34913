"""The dispatcher core under rank-aware routing (CaraServe Alg. 1): the ranks of its own assignments
between two worker stats, and the admission gate offering instances that could load the adapter."""
from __future__ import annotations

from dispatcher.dispatch_builders import DEAD_AFTER, chunk, heartbeat, sends, stats, submit

from shared.config import parse_config
from shared.events import InstanceStats, LayerRange
from shared.policy.lora_routing import RoutingOptions
from shared.policy.routing_policies import make_policy

from services.dispatcher.core import DispatchCore
from services.dispatcher.model_catalog import ModelCatalog

CONFIG = parse_config("""
[[models]]
name = "m"
path = "/models/m"
max_context = 256

[[adapters]]
name = "lo"
base = "m"
path = "/adapters/lo"
rank = 8

[[adapters]]
name = "hi"
base = "m"
path = "/adapters/hi"
rank = 64
""")


def rank_core(policy: str = "rank-aware") -> DispatchCore:
    # padded (BGMV): a batch costs |S| x max rank, so where a rank-64 request sits matters to a rank-8 one
    return DispatchCore(dispatcher_id="d", policy=make_policy(policy, options=RoutingOptions(kernel="padded")),
                        catalog=ModelCatalog.from_config(CONFIG), queue_bound=8, max_redispatches=2,
                        dead_after=DEAD_AFTER, block_size=16, max_batch=16, now=0.0)


def inst(iid: str, ranks: tuple[int, ...], *, room: int | None = None) -> InstanceStats:
    return InstanceStats(instance_id=iid, model="m", layers=LayerRange(start=0, end=2), running=len(ranks),
                         running_ranks=list(ranks), kv_blocks_total=64, adapters=["lo", "hi"],
                         adapter_room_bytes=room)


def workers(c: DispatchCore, i0: InstanceStats, i1: InstanceStats, *, resident0: tuple[str, ...] = ("lo", "hi"),
            resident1: tuple[str, ...] = ("lo", "hi"), now: float = 0.0) -> None:
    c.heartbeat(heartbeat("w0"), now)
    c.heartbeat(heartbeat("w1"), now)
    c.worker_stats(stats("w0", i0, adapters=resident0), now)
    c.worker_stats(stats("w1", i1, adapters=resident1), now)


def ranks_of(c: DispatchCore, iid: str, now: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    view = next(v for v in c.table.views("m", now) if v.instance_id == iid)
    return view.running_ranks, view.waiting_ranks


def test_a_burst_between_stats_is_routed_with_the_ranks_it_assigned() -> None:
    c = rank_core()
    workers(c, inst("i0", (8,) * 4), inst("i1", (8,) * 5))
    (a,) = sends(c.submit(submit("a", adapter="hi"), 0.1)[1])
    assert a.assignment.instance_id == "i0"  # 4 x rank 8 is cheaper to pad to 64 than 5 x rank 8
    assert ranks_of(c, "i0", 0.1) == ((8,) * 4, (64,))  # shown waiting until the worker's next stats
    # A rank-8 request: i0's batch is now padded to 64 for everyone, i1's stays at 8. Blind to a's
    # rank, i0 would look like the lighter batch (4 x rank 8 plus an unknown) and get it.
    (b,) = sends(c.submit(submit("b", adapter="lo"), 0.2)[1])
    assert b.assignment.instance_id == "i1"
    assert ranks_of(c, "i1", 0.2) == ((8,) * 5, (8,))


def test_ranks_of_finished_requests_leave_the_view_and_stats_take_over() -> None:
    c = rank_core()
    workers(c, inst("i0", ()), inst("i1", (8,) * 9))
    (a,) = sends(c.submit(submit("a", adapter="hi"), 0.1)[1])
    assert a.assignment.instance_id == "i0"
    # the worker's stats now show a running; then a finishes before the next stats
    c.worker_stats(stats("w0", inst("i0", (64,)), adapters=("lo", "hi")), 0.2)
    assert ranks_of(c, "i0", 0.2) == ((64,), ())
    c.stream(chunk("a", 0, [1], "w0", final=True), 0.3)
    assert ranks_of(c, "i0", 0.3) == ((), ())  # its rank no longer slows what comes next
    c.worker_stats(stats("w0", inst("i0", ()), adapters=("lo", "hi")), 0.4)
    assert ranks_of(c, "i0", 0.4) == ((), ())


def test_rank_aware_may_pick_an_instance_that_must_load_the_adapter() -> None:
    busy = inst("i0", (64,) * 8)  # hi resident here, a heavy rank-64 batch
    cold = inst("i1", (8,), room=1 << 30)  # hi not resident, room to load it
    for policy, expected in (("rank-aware", "i1"), ("least-load", "i0")):
        c = rank_core(policy)
        workers(c, busy, cold, resident0=("lo", "hi"), resident1=("lo",))
        (a,) = sends(c.submit(submit("a", adapter="hi"), 0.1)[1])
        assert a.assignment.instance_id == expected, policy  # least-load keeps today's resident-first gate


def test_no_room_to_load_keeps_the_request_off_a_cold_instance() -> None:
    c = rank_core()
    workers(c, inst("i0", (64,) * 8), inst("i1", (), room=0), resident1=("lo",))
    (a,) = sends(c.submit(submit("a", adapter="hi"), 0.1)[1])
    assert a.assignment.instance_id == "i0"  # i1 is idle but cannot fit hi
