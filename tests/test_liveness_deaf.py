"""The registry tells "I was deaf" from "my peers died" (services/registry/liveness_actor.py `_deaf`):
a NATS leader election that stalls its writes, a stall of its own loop, or not hearing its own
heartbeat gives every peer a fresh `dead_after` instead of marking them all dead at once. No I/O."""
from __future__ import annotations

from services.registry.liveness import LivenessTracker
from services.registry.liveness_actor import LivenessActor

W0, W1, SELF = ("workers", "w0"), ("workers", "w1"), ("services", "registry-1")


def test_grace_restarts_every_alive_peers_silence_and_leaves_the_dead_dead() -> None:
    t = LivenessTracker(dead_after=3.0)
    t.heard(W0, 0.0)
    t.heard(W1, 0.0)
    assert [c.key for c in t.expire(3.5)] == [W0, W1]
    t.heard(W0, 4.0)
    t.grace(9.0)  # the registry was deaf from 4 s to 9 s
    assert t.expire(11.9) == [] and t.silent(W0, 11.9) is False
    assert [c.key for c in t.expire(12.0)] == [W0]  # dead_after past the recovery, if it stays silent
    assert t.silent(W1, 12.0) is False  # dead already: not "silent" again


def actor() -> LivenessActor:
    return LivenessActor(None, dead_after=3.0, heartbeat_interval=1.0, self_service_id="registry-1")  # type: ignore[arg-type]


def test_a_stalled_write_or_loop_makes_the_registry_deaf_not_its_peers_dead() -> None:
    a = actor()
    a.workers.heard(W0, 0.0)
    a._last_tick = 0.0
    assert a._deaf(0.2) is False
    a._last_tick = 0.2
    a._timed_io(5.0)  # a put held 5 s (JetStream electing a leader)
    assert a._deaf(5.3) is True
    a.workers.grace(5.3)
    assert a.workers.expire(6.0) == []
    a._last_tick = 6.0
    assert a._deaf(6.2) is False  # once: the next tick judges normally
    a._last_tick = 6.2
    assert a._deaf(12.0) is True  # its own loop did not tick for 5.8 s


def test_not_hearing_its_own_heartbeat_means_the_registry_is_cut_off() -> None:
    a = actor()
    a.services.heard(SELF, 0.0)
    a.workers.heard(W0, 0.0)
    a._last_tick = 3.0
    assert a._deaf(3.1) is True  # its own heartbeat silent for dead_after: it cannot judge anyone
    a.services.heard(SELF, 3.2)
    a._last_tick = 3.3
    assert a._deaf(3.4) is False
