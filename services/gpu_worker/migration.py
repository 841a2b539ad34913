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

from services.gpu_worker.migration_tokens import move_by_tokens, refused
from shared.events.ctl import CtlDone, CtlReply, MigrateIn, MigrateOut

if TYPE_CHECKING:
    from services.gpu_worker.worker_context import WorkerContext

__all__ = ["migrate_in", "migrate_out", "refused"]


async def migrate_in(worker: "WorkerContext", msg: MigrateIn) -> CtlReply:
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


async def migrate_out(worker: "WorkerContext", msg: MigrateOut) -> CtlReply:
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
