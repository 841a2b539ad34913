"""The dispatcher's prefix index (pure): the latest summary per instance, stale ones dropped, an older
one never replacing a newer; and the core with prefix-aware routing on, fed worker summaries."""
from __future__ import annotations

from dispatcher.dispatch_builders import CONFIG, DEAD_AFTER, heartbeat, instance, sends, stats, submit

from shared.events import PrefixSummary
from shared.policy.routing_policies import make_policy
from shared.prefix_hash import block_hashes, prefix_salt
from services.dispatcher.core import DispatchCore
from services.dispatcher.model_catalog import ModelCatalog
from services.dispatcher.prefix_index import PrefixIndex
from services.dispatcher.prefix_score import PrefixRouter

BS = 16


def summary(iid: str, hashes: list[int], *, ts: float, seq: int, worker: str = "w0") -> PrefixSummary:
    return PrefixSummary(worker_id=worker, instance_id=iid, model="m", seq=seq, ts=ts, block_size=BS,
                         hashes=hashes, held_blocks=len(hashes))


def test_a_stale_summary_is_dropped_and_an_older_one_ignored() -> None:
    index = PrefixIndex(max_age_s=10.0)
    assert index.take(summary("i0", [1, 2, 3], ts=5.0, seq=3), now=100.0)
    assert not index.take(summary("i0", [9], ts=4.0, seq=9), now=101.0)  # older by the worker's clock
    assert not index.take(summary("i0", [9], ts=5.0, seq=2), now=101.0)  # same ts, older seq
    assert index.match("i0", [1, 2, 9], now=109.0) == 2
    assert index.match("i0", [1, 2, 9], now=110.5) == 0  # 10.5 s after it came: stale
    index.expire(110.5)
    assert "i0" not in index.held
    assert index.take(summary("i0", [7], ts=1.0, seq=0, worker="w0"), now=111.0)  # a restarted worker's


def prefix_core(*, prefix_routing: bool = True) -> DispatchCore:
    policy = make_policy("least-load")
    c = DispatchCore(dispatcher_id="dispatcher-test", policy=policy, catalog=ModelCatalog.from_config(CONFIG),
                     queue_bound=4, max_redispatches=2, dead_after=DEAD_AFTER, block_size=BS, max_batch=8, now=0.0,
                     prefix=PrefixRouter(policy, PrefixIndex()) if prefix_routing else None)
    # w0 idle (least load's pick), w1 with some KV in use
    for worker, iid, used in (("w0", "i0", 0), ("w1", "i1", 2)):
        c.heartbeat(heartbeat(worker), 0.0)
        c.worker_stats(stats(worker, instance(iid, used=used)), 0.0)
    return c


def test_the_core_routes_to_the_instance_whose_summary_holds_the_prefix() -> None:
    tokens = list(range(1, 8 * BS + 1))  # 8 full blocks (builders' prompts are 1..N)
    held = block_hashes(tokens, BS, prefix_salt("m", None))
    for routing, expected in ((True, "w1"), (False, "w0")):
        c = prefix_core(prefix_routing=routing)
        if c.prefix is not None:
            assert c.prefix.index.take(summary("i1", held[::-1], ts=0.5, seq=0, worker="w1"), 0.5)
        _, effects = c.submit(submit("r", prompt=8 * BS + 4), 1.0)
        assert [s.worker_id for s in sends(effects)] == [expected]


def test_a_summary_of_another_adapter_does_not_match() -> None:
    c = prefix_core()
    tokens = list(range(1, 8 * BS + 1))
    other = block_hashes(tokens, BS, prefix_salt("m", "m-lora"))  # the same tokens under an adapter
    assert c.prefix is not None and c.prefix.index.take(summary("i1", other, ts=0.5, seq=0, worker="w1"), 0.5)
    _, effects = c.submit(submit("r", prompt=8 * BS + 4), 1.0)
    assert [s.worker_id for s in sends(effects)] == ["w0"]
    assert c.prefix.counts["load"] == 1
