"""Migrating a running request to another worker (`MigrateIn` / `MigrateOut` on `...<id>.ctl`).

`MigrateOut(mode=...)` goes to the source; it answers when the move is over (the worker
runs it as its own task, so the source keeps serving meanwhile) with `CtlDone.migration`
(how it moved, the downtime) or `CtlRefused` (the request goes on here; nothing is lost).
A planner may send `MigrateIn` to the destination first, as a readiness check.

* **kv** (Llumnix pre-copy over the data plane): `migration_kv.py` (source) and
  `migration_dest.py` (destination). A corrupt or truncated chunk falls back to tokens.
* **tokens** (MELL §V's compute path, ServerlessLLM-style): the source takes the request out
  of its engine between two steps without ending its stream, and hands the destination an
  `Assignment` carrying the tokens generated so far (`resume_token_ids`) and the stream's
  next sequence number (`next_seq`). The destination re-prefills prompt + those tokens and
  goes on.

Either way the client's stream continues with consecutive sequence numbers, now with the
new `worker_id` on its chunks, which is how the dispatcher learns the new owner; a greedy
request yields exactly the tokens of an unmigrated run. If the destination refuses or
cannot be reached, the request resumes on the source from the same point.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from shared.events import AssignAccepted, AssignReply, Assignment
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateOut, MigrationReport
from shared.logging import get_logger
from shared.subjects import worker_assign
from shared.wire import TidalError

if TYPE_CHECKING:
    from services.gpu_worker.admission import Active
    from services.gpu_worker.worker import GpuWorker

log = get_logger("tidal.gpu_worker.migration")

ASSIGN_TIMEOUT_S = 10.0


def refused(worker: "GpuWorker", msg: msgspec.Struct, code: str, message: str) -> CtlRefused:
    return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,  # type: ignore[attr-defined]
                      worker_id=worker.worker_id, code=code, message=message[:2000])  # type: ignore[arg-type]


async def migrate_in(worker: "GpuWorker", msg: MigrateIn) -> CtlReply:
    """A readiness check (a planner's), or a KV migration's reservation (its source's: reserve_tokens > 0)."""
    if msg.instance_id not in worker.instances:
        return refused(worker, msg, "not_found", f"no instance {msg.instance_id} on {worker.worker_id}")
    if msg.mode == "kv":
        if worker.dataplane.plane is None:
            return refused(worker, msg, "unsupported", f"KV migration unavailable: {worker.dataplane.unavailable}")
        if msg.reserve_tokens > 0:
            return await worker.kv_inbound.reserve(msg)
    return CtlDone(idempotency_key=msg.idempotency_key, command="MigrateIn", worker_id=worker.worker_id,
                   detail=f"ready to take {msg.request_id} from {msg.source}")


async def migrate_out(worker: "GpuWorker", msg: MigrateOut) -> CtlReply:
    """Run one MigrateOut to its end (a task of its own; see GpuWorker.on_ctl)."""
    started = time.monotonic()
    if msg.destination == worker.worker_id:
        return refused(worker, msg, "invalid", "destination is this worker")
    entry = worker.active.get(msg.request_id)
    if entry is None or entry.aborted:
        return refused(worker, msg, "not_found", f"request {msg.request_id} is not running on {worker.worker_id}")
    if msg.request_id in worker.migrating:
        return refused(worker, msg, "busy", f"request {msg.request_id} is already being migrated")
    if msg.mode == "kv" and worker.dataplane.plane is None:
        return refused(worker, msg, "unsupported", f"KV migration unavailable: {worker.dataplane.unavailable}")
    worker.migrating.add(msg.request_id)
    try:
        if msg.mode == "kv":
            from services.gpu_worker.migration_kv import KvMove  # the data plane's modules

            return await KvMove(worker, msg, entry, started).run()
        return await move_by_tokens(worker, msg, entry, started)
    finally:
        worker.migrating.discard(msg.request_id)


async def move_by_tokens(worker: "GpuWorker", msg: MigrateOut, entry: "Active", started: float, *,
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
    local = msgspec.structs.replace(moved, instance_id=a.instance_id,
                                    idempotency_key=f"{a.request_id}:resume:{msg.idempotency_key}"[:128])
    worker.resume_here(local)
    log.warning("migration failed; the request continues on the source", request_id=a.request_id,
                destination=msg.destination, error=why)
    return refused(worker, msg, "busy", f"destination {msg.destination} did not take it ({why}); it continues here")


async def hand_over(worker: "GpuWorker", destination: str, moved: Assignment) -> str | None:
    """None when the destination accepted the assignment, else why not."""
    try:
        reply = await worker.bus.request(worker_assign(destination), moved, AssignReply, timeout=ASSIGN_TIMEOUT_S)
    except (TidalError, OSError) as exc:
        return repr(exc)
    if isinstance(reply, AssignAccepted):
        return None
    return f"{reply.reason}: {reply.message}"
