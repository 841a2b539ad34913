"""Token-mode moves of a running request (MELL §V's compute path), and what both modes share.

The source takes the request out of its engine between two steps without ending its stream and
hands the destination an `Assignment` with the tokens generated so far (`resume_token_ids`) and the
stream's next sequence number (`next_seq`); the destination re-prefills. If it refuses or cannot be
reached, the request resumes here from the same point. KV mode (`migration_kv.py`) falls back to it.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from shared.events import AbortRequest, AssignAccepted, AssignReply, Assignment
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, MigrateOut, MigrationReport
from shared.logging import get_logger
from shared.subjects import request_abort, worker_assign
from shared.wire import DeadlineExceeded, TidalError

if TYPE_CHECKING:
    from services.gpu_worker.admission import Active
    from services.gpu_worker.worker_context import WorkerContext

log = get_logger("tidal.gpu_worker.migration")

ASSIGN_TIMEOUT_S = 10.0
HAND_OVER_ATTEMPTS = 3  # same idempotency key each time: the destination replays, never starts it twice


def refused(worker: "WorkerContext", msg: msgspec.Struct, code: str, message: str) -> CtlRefused:
    return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,  # type: ignore[attr-defined]
                      worker_id=worker.worker_id, code=code, message=message[:2000])  # type: ignore[arg-type]



async def move_by_tokens(worker: "WorkerContext", msg: MigrateOut, entry: "Active", started: float, *,
                         fallback: str = "") -> CtlReply:
    """Token mode (also KV mode's fallback, `fallback` saying why)."""
    state = await entry.instance.detach(msg.request_id)
    if state is None:  # it finished (or was aborted) before the engine thread got to it
        return refused(worker, msg, "not_found", f"request {msg.request_id} ended before it could move")
    stopped_at = time.monotonic()
    tokens, next_seq = state
    worker.active.pop(msg.request_id, None)
    a = entry.assignment
    moved = msgspec.structs.replace(
        a, idempotency_key=f"{a.request_id}:migrate:{msg.idempotency_key}"[:128],
        instance_id=msg.destination_instance, resume_token_ids=tokens, next_seq=next_seq, kv_computed_tokens=0,
        handover=a.handover + 1,  # the destination's chunks take the stream over from next_seq (the fence)
    )
    why = await hand_over(worker, msg.destination, moved)
    if why is None:
        log.info("request migrated by tokens", request_id=a.request_id, destination=msg.destination,
                 tokens=len(tokens), next_seq=next_seq, fallback=fallback or None)
        now = time.monotonic()
        report = MigrationReport(requested_mode=msg.mode, mode="tokens", fallback=fallback[:2000],
                                 tokens=len(a.prompt_token_ids) + len(tokens), downtime_s=now - stopped_at,
                                 total_s=now - started)
        return CtlDone(idempotency_key=msg.idempotency_key, command="MigrateOut", worker_id=worker.worker_id,
                       detail=f"{a.request_id} moved to {msg.destination} with {len(tokens)} tokens to re-prefill",
                       migration=report)
    # the destination did not take it: it goes on here, from the same point
    local = resumed_on_source(worker, moved, msg.destination, instance_id=a.instance_id,
                              idempotency_key=f"{a.request_id}:resume:{msg.idempotency_key}"[:128])
    worker.resume_here(local)
    log.warning("migration failed; the request continues on the source", request_id=a.request_id,
                destination=msg.destination, error=why)
    return refused(worker, msg, "busy", f"destination {msg.destination} did not take it ({why}); it continues here")


async def hand_over(worker: "WorkerContext", destination: str, moved: Assignment) -> str | None:
    """None when the destination accepted the assignment, else why not.

    An unanswered try is sent AGAIN under the same idempotency key (a destination that did take it
    answers with a replay), so a slow destination never ends up running the request beside us."""
    why = "unanswered"
    for attempt in range(HAND_OVER_ATTEMPTS):
        try:
            reply = await worker.bus.request(worker_assign(destination), moved, AssignReply, timeout=ASSIGN_TIMEOUT_S)
        except DeadlineExceeded as exc:
            log.warning("hand-over unanswered; retrying under the same key", request_id=moved.request_id,
                        attempt=attempt + 1, destination=destination)
            why = repr(exc)
            continue
        except (TidalError, OSError) as exc:
            return repr(exc)
        if isinstance(reply, AssignAccepted):
            return None
        return f"{reply.reason}: {reply.message}"
    return why


def resumed_on_source(worker: "WorkerContext", moved: Assignment, destination: str, **changes: object) -> Assignment:
    """The assignment a request goes on with here after its hand-over to `destination` failed.

    It supersedes the one offered (handover + 1 more), and the destination is told to stop any copy
    of the offered one it may have started after all (an unanswered hand-over is ambiguous): its
    chunks, if any, are stale to every consumer from here on."""
    local = msgspec.structs.replace(moved, handover=moved.handover + 1, **changes)  # type: ignore[arg-type]
    abort = AbortRequest(request_id=moved.request_id, reason="superseded", ts=time.time(), worker_id=destination,
                         attempt=local.attempt, handover=local.handover)
    worker.spawn_task(_publish_quietly(worker, abort))
    return local


async def _publish_quietly(worker: "WorkerContext", abort: AbortRequest) -> None:
    try:
        await worker.bus.publish(request_abort(abort.request_id), abort)
    except (TidalError, OSError) as exc:  # its copy is fenced out anyway
        log.info("destination not told to drop a superseded copy", request_id=abort.request_id, error=repr(exc))
