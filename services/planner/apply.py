"""Applying one effect: its ctl commands, sent in order with a deadline, and the outcome they add up to.

Never raises: a refusal (`CtlRefused`, e.g. `not_found` for a request that ended, `busy`, `unsupported`
from a worker without the command), an error reply, no responder (the worker is gone), a deadline or
an unreachable registry is a `PlanFailed` naming the command and why. Every command carries
`deadline_ts` (now + the ctl timeout): one a partition held up past it is refused `expired` by the
worker, never executed on a view that is gone; such a refusal, and a MigrateOut refused `not_found`
(the request ended or moved since the view it was decided on), ends as `PlanCancelled("stale: ...")`,
not a failure. A MigrateOut that fails leaves
the request running on its source (the worker's contract), so nothing is lost. A MigrateOut whose
source dies before answering (`worker_lost`: the registry marks it dead, or it restarted) ends at
once as a `PlanFailed` saying so, not at the deadline: its request is the dispatcher's to re-dispatch,
and the destination drops the KV it reserved (services/gpu_worker/migration_dest.py).

Buddy groups (KunServe): FormGroup is JoinGroup to each member, with the group's registry record
written first and marked active after (`group_records.py`); DissolveGroup is LeaveGroup to each
member named by that record, a member answering `not_found` or `unsupported`, or with no worker
listening, being one that is not (or no longer) in the group, and the record is marked dissolved after; DropInstanceLayers and
RestoreInstanceLayers are DropLayers and RestoreLayers.
"""
from __future__ import annotations

import asyncio
import time

import msgspec
from collections.abc import Callable

from shared.bus import Bus
from shared.events.common import GroupMember
from shared.events.ctl import CtlCommand, CtlDone, CtlRefused, CtlRefusedCode, CtlReply, LeaveGroup, MigrateOut
from shared.events.plan import DissolveGroup, FormGroup, PlanApplied, PlanCancelled, PlanFailed
from shared.logging import get_logger
from shared.planner.effects import Effect, action_of, ctl_commands
from shared.subjects import worker_ctl
from shared.wire import NoResponders, TidalError

from services.planner import group_records, metrics

log = get_logger("tidal.planner.apply")
LIVENESS_POLL_S = 0.25  # how often a MigrateOut's source is checked while its answer is awaited
# worker -> what identifies its process now ("" unknown, None: dead or gone)
WorkerLiveness = Callable[[str], "str | None"]


class SourceLost(Exception):
    """The worker a command was sent to died (or restarted) before answering."""


async def _ask(bus: Bus, worker_id: str, command: object, timeout_s: float,
               liveness: WorkerLiveness | None) -> CtlReply:
    if isinstance(command, CtlCommand) and command.deadline_ts is None:
        # held up past its reply's deadline (a partition), it is stale: the worker drops it, unexecuted
        command = msgspec.structs.replace(command, deadline_ts=time.time() + timeout_s)
    if liveness is None or not isinstance(command, MigrateOut):
        return await bus.request(worker_ctl(worker_id), command, CtlReply, timeout=timeout_s)
    before = liveness(worker_id)
    reply = asyncio.ensure_future(bus.request(worker_ctl(worker_id), command, CtlReply, timeout=timeout_s))
    try:
        while not (await asyncio.wait({reply}, timeout=LIVENESS_POLL_S))[0]:
            now = liveness(worker_id)
            if now is None:
                raise SourceLost(f"{worker_id} died before answering")
            if before and now and now != before:
                raise SourceLost(f"{worker_id} restarted before answering ({before} -> {now})")
        return reply.result()
    finally:
        reply.cancel()


async def apply_effect(bus: Bus, effect: Effect, *, timeout_s: float,
                       worker_lost: WorkerLiveness | None = None) -> PlanApplied | PlanFailed | PlanCancelled:
    started = time.monotonic()
    action = action_of(effect)
    try:
        members: list[GroupMember] | None = None
        if isinstance(action, FormGroup):
            await group_records.record_forming(bus, action, effect.plan_id, timeout_s=timeout_s)
        elif isinstance(action, DissolveGroup):
            members = await group_records.members_of(bus, action.group_id, timeout_s=timeout_s)
        commands = ctl_commands(effect, group_members=members)
    except ValueError as exc:
        return PlanFailed(plan_id=effect.plan_id, ts=time.time(), action_index=0, message=str(exc)[:2000])
    except TidalError as exc:
        metrics.SKIPPED.labels("registry_unreachable").inc()
        return PlanFailed(plan_id=effect.plan_id, ts=time.time(), action_index=0,
                          message=f"the registry's groups bucket could not be read or written: {exc}"[:2000])
    for worker_id, command in commands:
        name = type(command).__name__
        try:
            reply = await _ask(bus, worker_id, command, timeout_s, worker_lost)
        except SourceLost as exc:
            metrics.SKIPPED.labels("source_lost").inc()
            return _failed(effect, command, f"{name} to {worker_id} ended unanswered: {exc}; the request is the "
                                            "dispatcher's to re-dispatch")
        except NoResponders:
            if isinstance(command, LeaveGroup):
                continue  # no such worker runs: a restarted or dead worker holds no group
            metrics.SKIPPED.labels("unreachable").inc()
            return _failed(effect, command, f"{name} to {worker_id} got no answer: no worker listens")
        except TidalError as exc:
            metrics.SKIPPED.labels("unreachable").inc()
            return _failed(effect, command, f"{name} to {worker_id} got no answer: {exc}")
        if isinstance(reply, CtlRefused) and isinstance(command, LeaveGroup) and reply.code in _NOT_A_MEMBER:
            continue  # that member is not in the group (never joined, or left already): leaving is done
        if isinstance(reply, CtlRefused):
            metrics.SKIPPED.labels(f"refused_{reply.code}").inc()
            message = f"{name} refused by {worker_id} ({reply.code}): {reply.message}"
            if reply.code == "expired" or (reply.code == "not_found" and isinstance(command, MigrateOut)):
                # decided on a view the cluster had left (the request ended or moved meanwhile, or the
                # command came too late): nothing was done, and it is not the request's failure
                log.info("effect stale on arrival", plan_id=effect.plan_id, error=message)
                _count_migration(effect, commands, "stale")
                return PlanCancelled(plan_id=effect.plan_id, ts=time.time(), message=f"stale: {message}"[:2000])
            return _failed(effect, command, message, refused=reply.code)
        assert isinstance(reply, CtlDone)
    if isinstance(action, (FormGroup, DissolveGroup)):
        await _mark(bus, action.group_id, "active" if isinstance(action, FormGroup) else "dissolved", timeout_s)
    _count_migration(effect, commands, "applied")
    return PlanApplied(plan_id=effect.plan_id, ts=time.time(), duration_s=time.monotonic() - started,
                       commands=len(commands))


_NOT_A_MEMBER = ("not_found", "unsupported")


async def _mark(bus: Bus, group_id: str, state: str, timeout_s: float) -> None:
    """The record's new state, best effort: the members have done it either way."""
    try:
        await group_records.set_state(bus, group_id, state, timeout_s=timeout_s)  # type: ignore[arg-type]
    except TidalError as exc:
        log.warning("group record not updated", group=group_id, state=state, error=repr(exc))


def _failed(effect: Effect, command: object, message: str, refused: CtlRefusedCode | None = None) -> PlanFailed:
    log.info("effect failed", plan_id=effect.plan_id, error=message)
    _count_migration(effect, [("", command)], "failed")
    return PlanFailed(plan_id=effect.plan_id, ts=time.time(), action_index=0, message=message[:2000], refused=refused)


def _count_migration(effect: Effect, commands: list, outcome: str) -> None:
    for _, command in commands:
        if isinstance(command, MigrateOut):
            metrics.MIGRATIONS.labels(command.mode, outcome).inc()


__all__ = ["apply_effect"]
