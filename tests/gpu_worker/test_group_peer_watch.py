"""The pure liveness rules of a buddy group's peers (services/gpu_worker/group/peer_watch.py)."""
from __future__ import annotations

from services.gpu_worker.group.peer_watch import PeerWatch


def watch(now: float = 0.0, incarnations: dict[str, str] | None = None) -> PeerWatch:
    w = PeerWatch(dead_after=3.0, join_timeout=10.0)
    w.watch("a-m", "g", {"b-m": "b"}, now, incarnations)
    return w


def test_a_restarted_peer_is_lost_at_its_first_heartbeat() -> None:
    w = PeerWatch(dead_after=3.0, join_timeout=10.0)
    w.heartbeat("b", "b-1", 0.0)  # heard before the join: that process is the member
    w.watch("a-m", "g", {"b-m": "b"}, 0.5)
    assert w.heartbeat("b", "b-1", 1.0) == []
    lost = w.heartbeat("b", "b-2", 1.5)  # well inside dead_after: only the incarnation tells
    assert [(x.instance_id, x.peer, x.reason) for x in lost] == [("a-m", "b-m", "restarted")]
    assert "b-1 -> b-2" in lost[0].detail


def test_the_registrys_incarnation_counts_when_no_heartbeat_was_heard() -> None:
    w = watch(incarnations={"b": "b-1"})
    assert [x.reason for x in w.heartbeat("b", "b-2", 0.2)] == ["restarted"]
    w2 = watch()  # nothing known: the first heard is the member's
    assert w2.heartbeat("b", "b-7", 0.2) == [] and w2.heartbeat("b", "b-7", 0.4) == []


def test_silence_past_dead_after_is_lost() -> None:
    w = watch()
    w.heartbeat("b", "b-1", 0.0)
    w.stats("b", {"b-m": "g"})
    assert w.due(3.0) == []
    assert [x.reason for x in w.due(3.1)] == ["silent"]


def test_a_peer_that_never_shows_it_joined_is_lost_after_the_join_timeout() -> None:
    w = watch()
    for t in (1.0, 4.0, 7.0, 9.9):
        w.heartbeat("b", "b-1", t)
        w.stats("b", {"b-m": None})  # alive, but not in the group
        assert w.due(t) == []
    w.heartbeat("b", "b-1", 10.1)
    assert [x.reason for x in w.due(10.1)] == ["never_joined"]
    joined = watch()
    joined.heartbeat("b", "b-1", 1.0)
    joined.stats("b", {"b-m": "g"})
    joined.heartbeat("b", "b-1", 10.5)
    assert joined.due(10.5) == []


def test_an_unheard_worker_never_joins() -> None:
    w = watch()
    assert w.due(9.0) == []
    lost = w.due(10.5)
    assert [x.reason for x in lost] == ["never_joined"] and "never heard" in lost[0].detail


def test_a_peer_that_left_is_reported_and_can_be_dropped() -> None:
    w = watch()
    w.heartbeat("b", "b-1", 0.0)
    w.stats("b", {"b-m": "g"})
    w.stats("b", {"b-m": None})
    assert w.due(0.3) == []  # not yet: a restarted worker's first stats look the same
    w.heartbeat("b", "b-1", 0.4)  # the process that joined: it left
    assert [x.reason for x in w.due(0.5)] == ["left"]
    w.drop_peer("a-m", "b-m")  # the member runs every layer itself
    assert w.due(0.6) == []
    w.forget("a-m")
    assert w.heartbeat("b", "b-9", 0.7) == []


def test_stats_out_of_the_group_before_a_new_incarnations_heartbeat_is_a_restart() -> None:
    """A restarted worker's first stats (no group) may overtake its first heartbeat: the peer is
    lost as `restarted` (its requests died with it), never as a clean leave."""
    w = watch()
    w.heartbeat("b", "b-1", 0.0)
    w.stats("b", {"b-m": "g"})
    w.stats("b", {"b-m": None})  # the new process's stats first
    assert w.due(0.5) == []
    lost = w.heartbeat("b", "b-2", 0.6)
    assert [(x.peer, x.reason) for x in lost] == [("b-m", "restarted")]
