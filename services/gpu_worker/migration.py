"""Migrating a running request to another worker (`MigrateIn` / `MigrateOut` on `...<id>.ctl`).

Token mode (MELL §V's compute path, ServerlessLLM-style): the source takes the request out
of its engine between two steps without ending its stream, and hands the destination an
`Assignment` carrying the tokens generated so far (`resume_token_ids`) and the stream's next
sequence number (`next_seq`). The destination re-prefills prompt + those tokens and goes
on; the client's stream continues with consecutive sequence numbers, now with the new
`worker_id` on its chunks, which is how the dispatcher learns the new owner. A greedy
request yields exactly the tokens of an unmigrated run.

If the destination refuses or cannot be reached, the request resumes on the source the same
way (re-prefill from its tokens): nothing is lost, and the reply says the move failed.

KV mode (Llumnix-style pre-copy over the data plane) needs the engine to hand over a
running sequence's state with its blocks (`BlockManager.export_tables/import_tables` and
`transfer.kv_blocks` are in place); until it does, `mode="kv"` is refused as `unsupported`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from shared.events import AssignAccepted, AssignReply, Assignment
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateOut
from shared.logging import get_logger
from shared.subjects import worker_assign
from shared.wire import TidalError

if TYPE_CHECKING:
    from services.gpu_worker.worker import GpuWorker

log = get_logger("tidal.gpu_worker.migration")

ASSIGN_TIMEOUT_S = 10.0


def _refused(worker: "GpuWorker", msg: MigrateIn | MigrateOut, code: str, message: str) -> CtlRefused:
    return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__, worker_id=worker.worker_id,
                      code=code, message=message)  # type: ignore[arg-type]


def migrate_in(worker: "GpuWorker", msg: MigrateIn) -> CtlReply:
    """Token mode needs nothing prepared: the source's Assignment is checked like any other."""
    if msg.mode != "tokens":
        return _refused(worker, msg, "unsupported", "KV migration is not implemented yet; use mode 'tokens'")
    if msg.instance_id not in worker.instances:
        return _refused(worker, msg, "not_found", f"no instance {msg.instance_id} on {worker.worker_id}")
    return CtlDone(idempotency_key=msg.idempotency_key, command="MigrateIn", worker_id=worker.worker_id,
                   detail=f"ready to take {msg.request_id} from {msg.source}")


async def migrate_out(worker: "GpuWorker", msg: MigrateOut) -> CtlReply:
    if msg.mode != "tokens":
        return _refused(worker, msg, "unsupported", "KV migration is not implemented yet; use mode 'tokens'")
    if msg.destination == worker.worker_id:
        return _refused(worker, msg, "invalid", "destination is this worker")
    entry = worker.active.get(msg.request_id)
    if entry is None or entry.aborted:
        return _refused(worker, msg, "not_found", f"request {msg.request_id} is not running on {worker.worker_id}")
    state = await entry.instance.detach(msg.request_id)
    if state is None:  # it finished (or was aborted) before the engine thread got to it
        return _refused(worker, msg, "not_found", f"request {msg.request_id} ended before it could move")
    tokens, next_seq = state
    worker.active.pop(msg.request_id, None)
    a = entry.assignment
    moved = msgspec.structs.replace(
        a, idempotency_key=f"{a.request_id}:migrate:{msg.idempotency_key}"[:128],
        instance_id=msg.destination_instance, resume_token_ids=tokens, next_seq=next_seq,
    )
    why = await _hand_over(worker, msg.destination, moved)
    if why is None:
        log.info("request migrated by tokens", request_id=a.request_id, destination=msg.destination,
                 tokens=len(tokens), next_seq=next_seq)
        return CtlDone(idempotency_key=msg.idempotency_key, command="MigrateOut", worker_id=worker.worker_id,
                       detail=f"{a.request_id} moved to {msg.destination} with {len(tokens)} tokens to re-prefill")
    # the destination did not take it: it goes on here, from the same point
    local = msgspec.structs.replace(moved, instance_id=a.instance_id,
                                    idempotency_key=f"{a.request_id}:resume:{msg.idempotency_key}"[:128])
    worker.resume_here(local)
    log.warning("migration failed; the request continues on the source", request_id=a.request_id,
                destination=msg.destination, error=why)
    return _refused(worker, msg, "busy", f"destination {msg.destination} did not take it ({why}); it continues here")


async def _hand_over(worker: "GpuWorker", destination: str, moved: Assignment) -> str | None:
    """None when the destination accepted the assignment, else why not."""
    try:
        reply = await worker.bus.request(worker_assign(destination), moved, AssignReply, timeout=ASSIGN_TIMEOUT_S)
    except (TidalError, OSError) as exc:
        return repr(exc)
    if isinstance(reply, AssignAccepted):
        return None
    return f"{reply.reason}: {reply.message}"
