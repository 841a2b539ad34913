"""A buddy group's peers lost (`peer_watch.py` decides), and this worker's members collapsing for it.

The worker hears every worker's heartbeats from its start (so a peer's incarnation is known before
a group forms) and, once a member of its joined a group, their stats (which group each instance
is in). A lost peer collapses the member here at once (`GroupMember.collapse`: every layer
restored, its own requests recomputed token-exact, the other owners' KV freed); the record is
marked `dissolved`, and the member remembers why, for the LeaveGroup that follows.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from shared.events.worker import WorkerHeartbeat, WorkerStats
from shared.logging import get_logger
from shared.subjects import worker_heartbeat, worker_stats

from .peer_watch import PeerLost, PeerWatch
from .records import with_state, write_record

if TYPE_CHECKING:
    from services.gpu_worker.instance import ModelInstance
    from shared.bus import Bus

    from .dataplane_transport import GroupRouter

log = get_logger("tidal.gpu_worker.group_ctl")
WATCH_S = 0.2  # how often the members' liveness is checked
# A peer not shown in the group by its worker's stats this long after the join never joined (the
# planner sends JoinGroup member by member, each between two engine steps).
JOIN_TIMEOUT_S = 10.0


class MemberLoss:
    def __init__(self, worker_id: str, instances: "dict[str, ModelInstance]", *, router: "Callable[[], GroupRouter]",
                 bus: "Callable[[], Bus]", spawn_task: Callable[[Coroutine[Any, Any, Any]], None],
                 crashed: Callable[[str, BaseException], None],
                 publish_stats: Callable[[], Coroutine[Any, Any, None]], dead_after: float) -> None:
        self.worker_id, self.instances = worker_id, instances
        self._router, self._bus, self._spawn, self._crashed = router, bus, spawn_task, crashed
        self._publish_stats = publish_stats
        self.watch = PeerWatch(dead_after=dead_after, join_timeout=JOIN_TIMEOUT_S)
        self._collapsed: dict[str, tuple[str, str]] = {}  # member instance -> (group it collapsed out of, why)
        self._watching = False

    async def start(self) -> None:
        await self._bus().subscribe(worker_heartbeat(), WorkerHeartbeat, self._on_heartbeat)

    async def joined(self, instance_id: str, group_id: str, peers: dict[str, str],
                     incarnations: dict[str, str]) -> None:
        """Member `instance_id` joined `group_id`; `peers`: the other members (instance -> worker)."""
        self._collapsed.pop(instance_id, None)
        self.watch.watch(instance_id, group_id, peers, time.monotonic(), incarnations)
        if not self._watching:
            self._watching = True
            await self._bus().subscribe(worker_stats(), WorkerStats, self._on_stats)
            self._spawn(self._watchdog())

    def left(self, instance_id: str) -> None:
        self.watch.forget(instance_id)

    def collapsed(self, instance_id: str) -> tuple[str, str] | None:
        """(the group member `instance_id` collapsed out of, why), or None."""
        return self._collapsed.get(instance_id)

    async def check(self) -> None:
        """Collapse every member with a peer lost by now."""
        for lost in self.watch.due(time.monotonic()):
            await self._lost(lost)

    async def _on_heartbeat(self, msg: WorkerHeartbeat, _ctx: object) -> None:
        for lost in self.watch.heartbeat(msg.worker_id, msg.incarnation, time.monotonic()):
            await self._lost(lost)  # a restarted worker holds no group: no need to wait for silence

    async def _on_stats(self, msg: WorkerStats, _ctx: object) -> None:
        if msg.worker_id != self.worker_id:
            self.watch.stats(msg.worker_id, {i.instance_id: i.group_id for i in msg.instances})

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            await self.check()

    async def _lost(self, lost: PeerLost) -> None:
        inst = self.instances.get(lost.instance_id)
        if lost.reason == "left" and inst is not None and inst.group is not None and inst.group.solo:
            self.watch.drop_peer(lost.instance_id, lost.peer)  # it runs every layer itself: nothing lost
            member = inst.group
            # ... and the peer never routes through it again: whatever of its KV is still here goes
            await inst.run_on_engine(lambda _e: member.executor.free_owner(lost.peer))
            return
        await self._collapse(lost)

    async def force(self, instance_id: str, why: str) -> bool:
        """Collapse member `instance_id` now although no peer is lost (a LeaveGroup refused `busy`
        past its deadline): its own requests are recomputed here, the other owners' KV freed; the
        peers see it left and collapse in turn. False: it is in no group (any more)."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.group is None:
            return False
        return await self._collapse(PeerLost(instance_id, "", self.worker_id, "left", why))

    async def _collapse(self, lost: PeerLost) -> bool:
        instance_id, peer = lost.instance_id, lost.peer
        inst = self.instances.get(instance_id)
        self.watch.forget(instance_id)
        if inst is None or inst.group is None or inst.group.collapsing:
            return False  # (a collapse already under way is the one that counts: handled once)
        inst.group.collapsing = True  # from now on it admits nothing (admission.refusal)
        group_id = inst.group.group_id or ""
        log.warning("buddy group member lost: running alone again", group=group_id, instance=instance_id,
                    lost=peer, worker=lost.worker, reason=lost.reason, detail=lost.detail)
        router = self._router()
        transport = router.members.get(instance_id)
        if transport is not None and peer:
            transport[1].fail_peer(peer)  # a remote-attention call waiting on it ends now

        def collapse(_engine: object) -> None:
            if inst.group is not None:
                inst.group.collapse()
                inst.group = None

        try:
            await inst.run_on_engine(collapse)
        except (RuntimeError, MemoryError) as exc:  # the engine's state is unknown: the worker must go
            self._crashed(instance_id, exc)
            return False
        router.forget(instance_id)
        why = f"member {peer} lost ({lost.reason}: {lost.detail})" if peer else lost.detail
        self._collapsed[instance_id] = (group_id, why)
        await self._publish_stats()
        await write_record(self._bus(), group_id,
                           lambda r: with_state(r, "dissolved") if r and r.state != "dissolved" else None)
        return True


__all__ = ["JOIN_TIMEOUT_S", "MemberLoss"]
