"""The dispatcher core with `mell` routing: the planner's placement hints route a request to the hinted
worker over the least-loaded one; stale hints, or hints under another routing policy, do not (pure: no
NATS, time passed in)."""
from __future__ import annotations

import msgspec
from dispatcher.dispatch_builders import CONFIG, DEAD_AFTER, heartbeat, instance, sends, stats, submit

from shared.events import PlacementEntry, PlacementHints
from shared.policy.routing_policies import make_policy
from services.dispatcher.core import DispatchCore
from services.dispatcher.model_catalog import ModelCatalog

BLOCK_BYTES = 16 * 1000  # 1000 KV bytes per token, 16-token blocks
C = 64 * BLOCK_BYTES  # MELL's capacity: an instance's 64 blocks


def mell_core(policy: str = "mell") -> DispatchCore:
    c = DispatchCore(dispatcher_id="dispatcher-test", policy=make_policy(policy),
                     catalog=ModelCatalog.from_config(CONFIG), queue_bound=4, max_redispatches=2,
                     dead_after=DEAD_AFTER, block_size=16, max_batch=8, now=0.0)
    # w0 is idle (least load's pick); w1 already holds a request
    for worker, iid, used, running in (("w0", "i0", 0, 0), ("w1", "i1", 8, 1)):
        c.heartbeat(heartbeat(worker), 0.0)
        inst = msgspec.structs.replace(instance(iid, used=used, running=running), kv_block_bytes=BLOCK_BYTES)
        c.worker_stats(stats(worker, inst), 0.0)
    return c


def hints(ts: float, worker: str, ttl: float = 3.0) -> PlacementHints:
    """Every class of model m to `worker` (MELL packs small requests beside the one on w1)."""
    cuts = [0, C // 8, C // 4, C // 3, C // 2, C]
    entries = [PlacementEntry(request_class=name, lower_bytes=lo, upper_bytes=hi, worker_id=worker, room_bytes=C // 2)
               for name, lo, hi in zip(("tiny", "T", "S", "M", "L"), cuts, cuts[1:])]
    return PlacementHints(model="m", ts=ts, capacity_bytes=C, entries=entries, valid_until=ts + ttl)


def test_a_hint_routes_a_request_to_the_hinted_worker() -> None:
    c = mell_core()
    _, effects = c.submit(submit("before"), 0.5)
    assert [s.worker_id for s in sends(effects)] == ["w0"]  # no hint yet: least load
    assert c.placement_hints(hints(1.0, "w1"), 1.0)
    _, effects = c.submit(submit("hinted", prompt=8), 1.5)
    assert [s.worker_id for s in sends(effects)] == ["w1"]  # the hinted worker, not the least loaded
    assert c.policy.counts["hinted"] == 1 and c.policy.counts["no_hint"] == 1  # type: ignore[attr-defined]


def test_stale_hints_fall_back_to_least_load() -> None:
    c = mell_core()
    c.placement_hints(hints(1.0, "w1", ttl=0.5), 1.0)
    _, effects = c.submit(submit("late"), 2.0)  # valid until 1.5
    assert [s.worker_id for s in sends(effects)] == ["w0"]
    assert c.policy.counts["stale"] == 1  # type: ignore[attr-defined]


def test_other_routing_policies_ignore_hints() -> None:
    c = mell_core("least-load")
    assert not c.placement_hints(hints(1.0, "w1"), 1.0)
    _, effects = c.submit(submit("x"), 1.5)
    assert [s.worker_id for s in sends(effects)] == ["w0"]
