"""Which buddy-group peers of this worker's members are lost. Pure: no I/O, the caller's clock.

A member (an instance here) depends on every other member's stage. A peer is lost when:

* its worker restarted: a heartbeat with another `incarnation` than the one it had when the
  member joined (a restarted worker holds no group: it came back within `dead_after`, so its
  silence alone would never tell);
* its worker fell silent for `dead_after` (the registry's threshold);
* it never joined: its worker's stats have not shown the peer instance in this group within
  `join_timeout` of the join (a JoinGroup that never reached it, or that it refused);
* it left while this member still routes through it: its stats showed it in the group, then
  not (reported as `left`; a member already running every layer alone ignores it). A left peer
  is reported only once a heartbeat of the incarnation that joined is heard after those stats: a
  restarted worker's first stats (no group) may overtake its first heartbeat, and its death must
  be told as `restarted` (its requests are gone), never as a clean leave.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LostReason = Literal["restarted", "silent", "never_joined", "left"]


@dataclass(frozen=True, slots=True)
class PeerLost:
    instance_id: str  # the member here
    peer: str  # the peer member's instance
    worker: str  # the peer's worker
    reason: LostReason
    detail: str


@dataclass
class _Peer:
    worker: str
    incarnation: str | None  # the worker's process when this member joined (None: not known yet)
    joined: bool = False  # its worker's stats showed it in the group
    out: bool = False  # ... and then not (a leave, or a restart whose heartbeat is yet to come)
    left: bool = False  # ... and a heartbeat of the incarnation that joined came after: it left


@dataclass
class _Watch:
    group_id: str
    since: float
    peers: dict[str, _Peer] = field(default_factory=dict)


class PeerWatch:
    def __init__(self, *, dead_after: float, join_timeout: float) -> None:
        self.dead_after = dead_after
        self.join_timeout = join_timeout
        self._heard: dict[str, tuple[float, str]] = {}  # worker -> (last heartbeat, its incarnation)
        self._watches: dict[str, _Watch] = {}  # member instance here -> its group's peers

    def incarnation(self, worker: str) -> str | None:
        heard = self._heard.get(worker)
        return heard[1] if heard is not None else None

    def heard(self, worker: str) -> tuple[float, str] | None:
        """`worker`'s last heartbeat (monotonic) and incarnation; None: never heard."""
        return self._heard.get(worker)

    def watch(self, instance_id: str, group_id: str, peers: dict[str, str], now: float,
              incarnations: dict[str, str] | None = None) -> None:
        """Start watching `peers` (peer instance -> worker) of member `instance_id`. A peer's
        incarnation is the one last heard, else `incarnations` (the registry's), else its next."""
        known = incarnations or {}
        self._watches[instance_id] = _Watch(group_id, now, {
            peer: _Peer(worker, self.incarnation(worker) or known.get(worker) or None)
            for peer, worker in peers.items()})

    def forget(self, instance_id: str) -> None:
        self._watches.pop(instance_id, None)

    def drop_peer(self, instance_id: str, peer: str) -> None:
        """Stop watching one peer of a member (it no longer depends on it)."""
        w = self._watches.get(instance_id)
        if w is not None:
            w.peers.pop(peer, None)

    def heartbeat(self, worker: str, incarnation: str, now: float) -> list[PeerLost]:
        """A heartbeat; returns the members whose peer on `worker` restarted (lost at once)."""
        self._heard[worker] = (now, incarnation)
        lost = []
        for instance_id, w in self._watches.items():
            for peer, p in w.peers.items():
                if p.worker != worker:
                    continue
                if p.incarnation is None:
                    p.incarnation = incarnation
                if p.incarnation == incarnation:
                    p.left = p.left or p.out  # the same process, out of the group: it left
                else:
                    lost.append(PeerLost(instance_id, peer, worker, "restarted",
                                         f"{worker} restarted ({p.incarnation} -> {incarnation})"))
        return lost

    def stats(self, worker: str, groups: dict[str, str | None]) -> None:
        """`worker`'s stats: each of its instances -> the group it is in (None: none)."""
        for w in self._watches.values():
            for peer, p in w.peers.items():
                if p.worker != worker or peer not in groups:
                    continue
                if groups[peer] == w.group_id:
                    p.joined = True
                elif p.joined:
                    p.out = True  # `left` once its next heartbeat shows the same incarnation

    def due(self, now: float) -> list[PeerLost]:
        """Peers lost by now: silent, never joined, or left (one per member, the first found)."""
        out = []
        for instance_id, w in self._watches.items():
            for peer, p in w.peers.items():
                lost = self._lost(w, p, now)
                if lost is not None:
                    out.append(PeerLost(instance_id, peer, p.worker, lost[0], lost[1]))
                    break
        return out

    def _lost(self, w: _Watch, p: _Peer, now: float) -> tuple[LostReason, str] | None:
        heard = self._heard.get(p.worker)
        if heard is not None and now - heard[0] > self.dead_after:
            return "silent", f"{p.worker} silent for {now - heard[0]:.1f} s"
        if p.left:
            return "left", f"it left {w.group_id}"
        if not p.joined and now - w.since > self.join_timeout:
            why = "its worker was never heard" if heard is None else "its worker's stats never showed it joined"
            return "never_joined", f"not a member of {w.group_id} {self.join_timeout:.0f} s after the join: {why}"
        return None


__all__ = ["LostReason", "PeerLost", "PeerWatch"]
