"""Liveness from heartbeats: a pure state machine, time passed in (no I/O, no clock reads).

    tracker = LivenessTracker(dead_after=3.0, forget_after=None)
    tracker.heard(("workers", "cpu-0"), now, incarnation="gpu_worker-cpu-0-a1")  # Change(alive) or None
    tracker.expire(now)        # [Change(dead)] for peers silent for >= dead_after
    tracker.forgettable(now)   # dead peers silent for >= forget_after (their records may go)

The registry feeds it every heartbeat it receives (stamped with its own monotonic clock, so
clock skew between hosts does not matter) and calls `expire` from a timer; each Change is
turned into a catalog write and a published event. A peer is alive again as soon as a
heartbeat arrives; a heartbeat with a new incarnation (the process restarted) is reported as
a Change even when the peer never looked dead. `grace(now)` restarts every alive peer's silence
at `now`: the registry calls it when it was itself deaf (see liveness_actor.py), so a NATS leader
election is not read as the death of every peer.
"""
from __future__ import annotations

from dataclasses import dataclass

PeerKey = tuple[str, str]  # (catalog bucket, record key), e.g. ("workers", "cpu-0")


@dataclass(frozen=True)
class Change:
    """A peer became alive (new, back from dead, or restarted) or dead."""

    key: PeerKey
    alive: bool
    incarnation: str
    restarted: bool = False  # alive with a different incarnation than before
    silent_s: float = 0.0  # for dead: how long it had been silent


@dataclass
class _Peer:
    last_heard: float
    alive: bool
    incarnation: str


class LivenessTracker:
    """Which peers are alive, given when each was last heard from."""

    def __init__(self, dead_after: float, *, forget_after: float | None = None) -> None:
        if dead_after <= 0:
            raise ValueError(f"dead_after: expected > 0 seconds, got {dead_after}")
        if forget_after is not None and forget_after < dead_after:
            raise ValueError(f"forget_after ({forget_after}) must be >= dead_after ({dead_after})")
        self.dead_after = dead_after
        self.forget_after = forget_after
        self._peers: dict[PeerKey, _Peer] = {}

    def heard(self, key: PeerKey, now: float, incarnation: str = "") -> Change | None:
        """A heartbeat from `key` arrived at `now`; returns the Change it causes, if any."""
        peer = self._peers.get(key)
        if peer is None:
            self._peers[key] = _Peer(now, True, incarnation)
            return Change(key, True, incarnation)
        restarted = bool(incarnation) and bool(peer.incarnation) and incarnation != peer.incarnation
        was_alive = peer.alive
        peer.last_heard = max(peer.last_heard, now)
        peer.alive = True
        if incarnation:
            peer.incarnation = incarnation
        if not was_alive or restarted:
            return Change(key, True, peer.incarnation, restarted=restarted)
        return None

    def seed(self, key: PeerKey, now: float, *, alive: bool, incarnation: str = "") -> None:
        """Track a peer known from the catalog (at start), as if last heard at `now`."""
        if key not in self._peers:
            self._peers[key] = _Peer(now, alive, incarnation)

    def grace(self, now: float) -> None:
        """The registry could not hear or write for a while (its own writes stalled: NATS electing a
        leader; its loop stalled): what it missed is not the peers' silence. Every alive peer's
        silence counts from `now`, so none dies before `dead_after` past the registry's recovery."""
        for peer in self._peers.values():
            if peer.alive:
                peer.last_heard = max(peer.last_heard, now)

    def silent(self, key: PeerKey, now: float) -> bool:
        """Whether `key` is tracked, alive, and silent for at least `dead_after` at `now`."""
        peer = self._peers.get(key)
        return peer is not None and peer.alive and now - peer.last_heard >= self.dead_after

    def expire(self, now: float) -> list[Change]:
        """Mark dead every alive peer silent for at least `dead_after`; returns those Changes."""
        changes = []
        for key, peer in self._peers.items():
            silent = now - peer.last_heard
            if peer.alive and silent >= self.dead_after:
                peer.alive = False
                changes.append(Change(key, False, peer.incarnation, silent_s=silent))
        return changes

    def forgettable(self, now: float) -> list[PeerKey]:
        """Dead peers silent for at least `forget_after` (never, when it is None); stops tracking them."""
        if self.forget_after is None:
            return []
        gone = [k for k, p in self._peers.items() if not p.alive and now - p.last_heard >= self.forget_after]
        for key in gone:
            del self._peers[key]
        return gone

    def forget(self, key: PeerKey) -> None:
        """Stop tracking `key` (its record was deleted: a clean shutdown)."""
        self._peers.pop(key, None)

    def next_due(self) -> float | None:
        """The earliest time an alive peer could be marked dead (None: nothing to watch)."""
        due = [p.last_heard + self.dead_after for p in self._peers.values() if p.alive]
        return min(due) if due else None

    def is_alive(self, key: PeerKey) -> bool | None:
        """True/False for a tracked peer, None for an unknown one."""
        peer = self._peers.get(key)
        return None if peer is None else peer.alive

    def last_heard(self, key: PeerKey) -> float | None:
        peer = self._peers.get(key)
        return None if peer is None else peer.last_heard

    def __len__(self) -> int:
        return len(self._peers)


def needs_write(
    stored_state: str, stored_heartbeat_ts: float, state: str, now_wall: float, touch_every: float
) -> bool:
    """Whether a heartbeat should be written to the peer's record: its state changed, or the
    stored heartbeat time is older than `touch_every` (so `tidal status` shows a fresh age
    without a catalog write per heartbeat when heartbeats are frequent)."""
    return stored_state != state or now_wall - stored_heartbeat_ts >= touch_every
