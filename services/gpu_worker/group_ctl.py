"""JoinGroup / DropLayers / LeaveGroup: this worker's instances as buddy-group members.

* `JoinGroup` — the instance becomes the member running its stage of the group's layer
  split (`members`, each a worker, an instance and the layers it keeps): requests admitted
  to it run stage by stage across the members over the data plane; its running requests
  become victims whose KV of the other members' layers is exchanged while they decode on
  remote attention (services/gpu_worker/group/). The group's record is written to the
  registry's groups bucket (state `active`).
* `DropLayers` — free the weights of layers outside the member's stage; the bytes are KV
  blocks at its next step.
* `RestoreLayers` — load dropped layers back from the host copy (or the checkpoint), one at a
  time as free KV blocks give the bytes (live KV is never evicted: the pool is charged only as
  KV frees), answered once all are back; the group's record is marked `restoring` (the
  dispatcher routes nothing new to it; a `DropLayers` after it marks it `active` again). Once
  the member holds every layer its requests migrate back (`group/migrate_back.py`).
* `LeaveGroup` — run alone again (restoring what is still dropped); refused `busy` while
  leaving would lose KV: micro-batches in flight, an exchange, other owners' KV here, or its
  own requests not yet migrated back. The record is marked `dissolved` once the last member
  has left. A member still refused `FORCE_LEAVE_AFTER_S` after its first RestoreLayers (a group
  stuck `restoring`: an owner that never migrates back, KV that never frees) leaves by force: it
  collapses as if a peer were lost (its requests recomputed token-exact, the other owners' KV
  freed), and the peers, seeing it left, collapse in turn; the planner's DissolveGroup then applies.
* Before joining, every other member is checked in the registry (a live worker holding that
  instance of the model: `group/member_check.py`); one that is not there is refused `not_found`
  and nothing joins.
* A member collapses the group here (the engine restores every layer and runs alone, its requests
  recomputed token-exact: `GroupMember.collapse`; the record is marked `dissolved`) as soon as a
  peer is lost (`group/peer_watch.py` decides, `group/member_loss.py` acts): its worker restarted
  (a new `incarnation` in its heartbeat), fell silent for `dead_after`, never joined within
  `JOIN_TIMEOUT_S`, or left while this member still routes through it. The dead worker's own requests are the dispatcher's to re-dispatch. A
  LeaveGroup answers `CtlDone` for a member that collapsed out of the group, and collapses at once
  a member whose blocker can never clear (a lost peer).

Every command runs on the instance's engine thread between two steps. Idempotent per key.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from services.gpu_worker.group.dataplane_transport import GroupRouter
from services.gpu_worker.group.member import GroupMember, Stage
from services.gpu_worker.group.member_check import check_members
from services.gpu_worker.group.member_loss import MemberLoss
from services.gpu_worker.group.records import Change, with_state, write_record
from shared.events.ctl import (
    CtlDone, CtlRefused, CtlRefusedCode, CtlReply, DropLayers, JoinGroup, LeaveGroup, RestoreLayers,
)
from shared.events.registry import GroupRecord
from shared.logging import get_logger
from shared.registry_client import RegistryClient

if TYPE_CHECKING:
    from services.gpu_worker.dataplane import WorkerDataPlane
    from services.gpu_worker.instance import ModelInstance
    from shared.bus import Bus

log = get_logger("tidal.gpu_worker.group_ctl")
GroupCommand = JoinGroup | DropLayers | LeaveGroup | RestoreLayers
GROUP_COMMANDS = (JoinGroup, DropLayers, LeaveGroup, RestoreLayers)
MEMORY = 10_000
RESTORE_TIMEOUT_S = 120.0  # a restore waiting this long for KV to free is refused (insufficient_memory)
RESTORE_POLL_S = 0.05
# A LeaveGroup refused `busy` this long after the member's first RestoreLayers leaves by force: longer
# than a restore waiting for KV to free (RESTORE_TIMEOUT_S) plus a migrate-back, so only a stuck one.
FORCE_LEAVE_AFTER_S = RESTORE_TIMEOUT_S + 30.0
FORCE_LEAVE_ENV = "TIDAL_GROUP_FORCE_LEAVE_AFTER_S"  # seconds, overrides it (tests: a stuck group in seconds)


def configured_force_leave_s() -> float:
    raw = os.environ.get(FORCE_LEAVE_ENV, "")
    if not raw:
        return FORCE_LEAVE_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{FORCE_LEAVE_ENV} must be a positive number of seconds, got {raw!r}")
    return value


class GroupControl:
    """`instances`: the worker's (live dict); `bus`: its bus once started; `spawn_task` runs a
    coroutine beside the mailbox; `crashed(instance, exc)` stops the worker; `publish_stats`
    sends stats now (peers learn of a join or a leave from them)."""

    def __init__(self, worker_id: str, instances: "dict[str, ModelInstance]", dataplane: "WorkerDataPlane", *,
                 bus: "Callable[[], Bus]", spawn_task: Callable[[Coroutine[Any, Any, Any]], None],
                 crashed: Callable[[str, BaseException], None],
                 publish_stats: "Callable[[], Coroutine[Any, Any, None]]", dead_after: float = 3.0,
                 force_leave_after_s: float | None = None) -> None:
        self.worker_id, self.instances, self.dataplane = worker_id, instances, dataplane
        self.force_leave_after_s = force_leave_after_s if force_leave_after_s is not None else configured_force_leave_s()
        self._restoring_since: dict[str, float] = {}  # member instance -> its first RestoreLayers (monotonic)
        self._bus, self._publish_stats = bus, publish_stats
        self._router: GroupRouter | None = None
        self._done: OrderedDict[str, CtlReply] = OrderedDict()
        self.loss = MemberLoss(worker_id, instances, router=lambda: self.router, bus=bus, spawn_task=spawn_task,
                               crashed=crashed, publish_stats=publish_stats, dead_after=dead_after)
        self.watch = self.loss.watch  # the other workers' heartbeats (a KV migration's destination asks too)

    def set_dead_after(self, dead_after: float) -> None:
        """The registry's `dead_after` (from the config): a peer silent this long is lost."""
        self.watch.dead_after = dead_after

    @property
    def bus(self) -> "Bus":
        return self._bus()

    @property
    def router(self) -> GroupRouter:
        if self._router is None:  # the worker's data plane exists once the worker has started
            self._router = GroupRouter(self.dataplane, lambda i: i in self.instances)
        return self._router

    async def start(self) -> None:
        """Accept group frames on the data plane (if it is up); hear the workers' heartbeats from
        now on, so a peer's incarnation is known before it joins a group with us."""
        if self.dataplane.plane is not None:
            self.router.install()
        await self.loss.start()

    async def handle(self, msg: GroupCommand) -> CtlReply:
        seen = self._done.get(msg.idempotency_key)
        if isinstance(seen, CtlDone):
            return CtlDone(**{**{f: getattr(seen, f) for f in seen.__struct_fields__}, "replayed": True})
        if isinstance(msg, JoinGroup):
            reply = await self._join(msg)
        elif isinstance(msg, DropLayers):
            reply = await self._drop(msg)
        elif isinstance(msg, RestoreLayers):
            reply = await self._restore(msg)
        else:
            reply = await self._leave(msg)
        if isinstance(reply, CtlDone):
            self._done[msg.idempotency_key] = reply
            if len(self._done) > MEMORY:
                self._done.popitem(last=False)
        return reply

    def _refused(self, msg: GroupCommand, code: CtlRefusedCode, message: str) -> CtlRefused:
        return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                          worker_id=self.worker_id, code=code, message=message[:2000])

    def _done_reply(self, msg: GroupCommand, detail: str) -> CtlDone:
        return CtlDone(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                       worker_id=self.worker_id, detail=detail[:2000])

    async def _join(self, msg: JoinGroup) -> CtlReply:
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            return self._refused(msg, "not_found", f"no instance {msg.instance_id} on {self.worker_id}")
        if inst.group is not None:
            return self._refused(msg, "busy", f"{msg.instance_id} is already in group {inst.group.group_id}")
        if self.dataplane.plane is None:
            return self._refused(msg, "unsupported", f"no data plane: {self.dataplane.unavailable}")
        stages = sorted((Stage(m.instance_id, range(m.layers.start, m.layers.end)) for m in msg.members),
                        key=lambda s: s.layers.start)
        if msg.instance_id not in {m.instance_id for m in msg.members}:
            return self._refused(msg, "invalid", f"{msg.instance_id} is not among the members of {msg.group_id}")
        checked = await check_members(RegistryClient(self.bus, timeout=2.0), msg.members, me=self.worker_id,
                                      model=inst.model, local=self._model_here)
        if checked.problem is not None:  # nothing joined: no record is written, no frame sent
            return self._refused(msg, "busy" if checked.unreachable else "not_found", checked.problem)
        self.router.install()
        self._restoring_since.pop(msg.instance_id, None)  # (an earlier group's restore)
        transport = self.router.transport(inst, {m.instance_id: m.worker_id for m in msg.members})
        member = GroupMember(inst.engine, msg.instance_id, transport)

        def join(_engine: object) -> None:
            member.join(msg.group_id, stages, drop=False)
            inst.group = member

        try:
            await inst.run_on_engine(join)
        except ValueError as exc:
            self.router.forget(msg.instance_id)
            return self._refused(msg, "invalid", str(exc))
        self.router.activate(msg.instance_id)
        await self.loss.joined(msg.instance_id, msg.group_id, {m.instance_id: m.worker_id for m in msg.members
                                                               if m.worker_id != self.worker_id}, checked.incarnations)
        await self._publish_stats()  # the other members see this one joined
        await self._record(msg.group_id, lambda r: r or GroupRecord(
            group_id=msg.group_id, model=inst.model, members=msg.members, state="active", plan_id=msg.plan_id,
            created_ts=time.time()))
        log.info("joined buddy group", group=msg.group_id, instance=msg.instance_id,
                 layers=[member.layers.start, member.layers.stop], victims=len(member.victims))
        return self._done_reply(msg, f"stage layers [{member.layers.start}, {member.layers.stop}); "
                                     f"{len(member.victims)} running requests exchange their KV")

    async def _drop(self, msg: DropLayers) -> CtlReply:
        inst = self.instances.get(msg.instance_id)
        if inst is None or inst.group is None or inst.group.group_id != msg.group_id:
            return self._refused(msg, "not_found", f"{msg.instance_id} is not a member of {msg.group_id} here")
        member = inst.group
        if msg.layers.start < member.layers.stop and member.layers.start < msg.layers.end:
            return self._refused(msg, "invalid", f"layers [{msg.layers.start}, {msg.layers.end}) overlap the stage "
                                                 f"[{member.layers.start}, {member.layers.stop}) this member runs")
        try:
            freed = await inst.run_on_engine(lambda _e: member.drop_layers(msg.layers.start, msg.layers.end))
        except RuntimeError as exc:
            return self._refused(msg, "busy", str(exc))
        self._restoring_since.pop(msg.instance_id, None)  # the restore is cancelled: no deadline runs
        await self._record(msg.group_id, lambda r: with_state(r, "active") if r and r.state == "restoring" else None)
        return self._done_reply(msg, f"released {freed} bytes of weights to the KV pool")

    async def _restore(self, msg: RestoreLayers) -> CtlReply:
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            return self._refused(msg, "not_found", f"no instance {msg.instance_id} on {self.worker_id}")
        member = inst.group
        if member is not None and member.group_id is not None:
            group_id = member.group_id
            self._restoring_since.setdefault(msg.instance_id, time.monotonic())
            await self._record(group_id, lambda r: with_state(r, "restoring") if r and r.state == "active" else None)
        start, end = msg.layers.start, msg.layers.end

        def restore(engine: object) -> bool:
            if inst.group is not None:
                return inst.group.restore_layers(start, end)
            try:
                inst.engine.restore_layers(start, end)
            except MemoryError:
                return False
            return True

        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        while True:
            try:
                if await inst.run_on_engine(restore):
                    break
            except (ValueError, RuntimeError) as exc:
                return self._refused(msg, "invalid", str(exc))
            if time.monotonic() > deadline:
                return self._refused(msg, "insufficient_memory", f"layers [{start}, {end}) of {msg.instance_id}: "
                                     f"live KV held their bytes for {RESTORE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(RESTORE_POLL_S)  # KV frees as requests finish
        return self._done_reply(msg, f"layers [{start}, {end}) are resident again")

    async def _leave(self, msg: LeaveGroup) -> CtlReply:
        inst = self.instances.get(msg.instance_id)
        if inst is not None and inst.group is not None and inst.group.group_id == msg.group_id:
            await self.loss.check()  # a lost peer: the member collapses now instead of refusing `busy`
        collapsed = self.loss.collapsed(msg.instance_id)
        if inst is not None and inst.group is None and collapsed is not None and collapsed[0] == msg.group_id:
            return self._done_reply(msg, f"left {msg.group_id}: {collapsed[1]}; it runs alone again "
                                         "(every layer resident, its requests recomputed)")
        if inst is None or inst.group is None or inst.group.group_id != msg.group_id:
            return self._refused(msg, "not_found", f"{msg.instance_id} is not a member of {msg.group_id} here")
        member = inst.group

        def leave(engine: object) -> None:
            held = set(member.engine.runner.resident_layers())
            missing = [l for l in range(member.engine.runner.cfg.num_layers) if l not in held]
            blocker = member.leave_blocker()
            if blocker:
                raise RuntimeError(f"{msg.instance_id} cannot leave {msg.group_id} yet: {blocker}")
            if missing:
                member.engine.restore_layers(missing[0], missing[-1] + 1)
            member.leave()
            inst.group = None

        try:
            await inst.run_on_engine(leave)
        except (RuntimeError, MemoryError) as exc:
            since = self._restoring_since.get(msg.instance_id)
            if since is None or time.monotonic() - since < self.force_leave_after_s:
                return self._refused(msg, "busy" if isinstance(exc, RuntimeError) else "insufficient_memory", str(exc))
            why = (f"left by force {time.monotonic() - since:.0f} s after its restore began (deadline "
                   f"{self.force_leave_after_s:.0f} s): {exc}")
            log.warning("buddy group member stuck restoring: leaving by force", group=msg.group_id,
                        instance=msg.instance_id, why=why)
            if await self.loss.force(msg.instance_id, why):
                self._restoring_since.pop(msg.instance_id, None)
                return self._done_reply(msg, f"left {msg.group_id}: {why}; it runs alone again "
                                             "(every layer resident, its requests recomputed)")
            return self._refused(msg, "busy", f"{msg.instance_id} could not leave {msg.group_id} by force: {exc}")
        self._restoring_since.pop(msg.instance_id, None)
        self.router.forget(msg.instance_id)
        self.loss.left(msg.instance_id)
        await self._publish_stats()  # the other members see this one left
        left = msg.instance_id

        def dissolve(r: GroupRecord | None) -> GroupRecord | None:
            if r is None:
                return None
            members = [m for m in r.members if m.instance_id != left]
            if len(members) >= 2:
                return None  # the record keeps its members until the group dissolves
            return with_state(r, "dissolved")

        await self._record(msg.group_id, dissolve)
        return self._done_reply(msg, f"left {msg.group_id}; every layer is resident again")

    def _model_here(self, instance_id: str) -> str | None:
        inst = self.instances.get(instance_id)
        return inst.model if inst is not None else None

    async def _record(self, group_id: str, change: Change) -> None:
        await write_record(self.bus, group_id, change)

    def close(self) -> None:
        if self._router is not None:
            self._router.close()

