"""Least load when a worker's stats lag (pure): a worker's stats carry its engine's last snapshot, as old as
the engine's current step, so stats that do not list a request this dispatcher sent keep it counted (the
next requests go elsewhere), and a finished request the stats still list is counted out until they drop it."""
from __future__ import annotations

import msgspec
from dispatcher.dispatch_builders import chunk, core, instance, sends, stats, submit, two_workers

from shared.events import RequestLoad


def listing(iid: str, *rids: str, running: int | None = None, used: int = 0):
    inst = instance(iid, running=len(rids) if running is None else running, used=used)
    return msgspec.structs.replace(inst, requests=[RequestLoad(request_id=r, prompt_tokens=64) for r in rids])


def test_stats_that_do_not_list_a_sent_request_keep_it_counted() -> None:
    c = core(max_batch=8)
    two_workers(c)
    _, first = c.submit(submit("a", prompt=64), 1.0)
    assert [s.worker_id for s in sends(first)] == ["w0"]
    # w0's engine is in a long step: its stats (fresh messages, old snapshot) still show it idle
    c.worker_stats(stats("w0", listing("i0")), 1.2)
    c.worker_stats(stats("w1", listing("i1")), 1.2)
    _, second = c.submit(submit("b", prompt=64), 1.3)
    assert [s.worker_id for s in sends(second)] == ["w1"]  # not onto w0 again
    # the snapshots catch up: each lists its request; then a third goes by the listed load
    c.worker_stats(stats("w0", listing("i0", "a", used=4)), 2.0)
    c.worker_stats(stats("w1", listing("i1", "b", used=8)), 2.0)
    _, third = c.submit(submit("c", prompt=64), 2.1)
    assert [s.worker_id for s in sends(third)] == ["w0"]


def test_a_finished_request_still_listed_is_counted_out() -> None:
    c = core(max_batch=8)
    two_workers(c)
    c.submit(submit("a", prompt=64), 1.0)  # -> w0
    c.submit(submit("b", prompt=64), 1.0)  # -> w1
    c.worker_stats(stats("w0", listing("i0", "a")), 1.5)
    c.worker_stats(stats("w1", listing("i1", "b")), 1.5)
    c.stream(chunk("a", 0, [5, 6], "w0", final=True, prompt=64), 2.0)  # a finishes on w0
    c.worker_stats(stats("w0", listing("i0", "a")), 2.1)  # a stale snapshot still lists it
    view = {v.worker_id: v for v in c.table.views("m", 2.2)}
    assert view["w0"].running_requests + view["w0"].waiting_requests == 0
    assert view["w1"].running_requests + view["w1"].waiting_requests == 1
    c.worker_stats(stats("w0", listing("i0")), 2.5)  # a fresh one does not
    assert "i0" not in c.table.loads


def test_stats_without_a_request_list_are_taken_as_current() -> None:
    c = core(max_batch=8)
    two_workers(c)
    c.submit(submit("a", prompt=64), 1.0)  # -> w0
    c.worker_stats(stats("w0", instance("i0", running=1)), 1.5)  # counts it, lists nothing
    view = {v.worker_id: v for v in c.table.views("m", 1.6)}
    assert view["w0"].running_requests + view["w0"].waiting_requests == 1  # once, not twice
