"""Which assignments a worker takes: the typed refusals and bad-request checks, and the entry an
admitted request keeps in the worker's active table (services/gpu_worker/worker.py).

No I/O: `refusal` reads the instances' latest snapshots, which their engine threads leave.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.gpu_worker.instance import ModelInstance
from shared.events import AssignRejectReason, Assignment
from shared.wire import BadRequest


@dataclass(slots=True)
class Active:
    """A request admitted here, until its stream ends (or it moves away)."""

    instance: ModelInstance
    key: str
    deadline_ts: float | None
    assignment: Assignment  # kept for migration (services/gpu_worker/migration.py)
    aborted: bool = False


def refusal(a: Assignment, *, worker_id: str, draining: bool, instances: Mapping[str, ModelInstance],
            active: Mapping[str, Active], max_waiting: int) -> tuple[AssignRejectReason, str] | None:
    """Why the worker cannot take `a` now (None: it can). Raises BadRequest for a malformed one.
    `max_waiting`: per instance, requests admitted but not yet running."""
    if draining:
        return "draining", f"worker {worker_id} is draining"
    inst = instances.get(a.instance_id)
    if inst is not None and not inst.accepting:
        return "model_not_loaded", f"instance {a.instance_id} of {a.model} is being evicted from {worker_id}"
    if inst is None or inst.model != a.model:
        served = ", ".join(f"{i.instance_id} ({i.model})" for i in instances.values()) or "none yet"
        return "model_not_loaded", f"worker {worker_id} has no instance {a.instance_id} of {a.model}; it serves {served}"
    if inst.group is not None and inst.group.collapsing:
        return "no_capacity", f"instance {a.instance_id} is collapsing out of buddy group {inst.group.group_id}"
    if a.adapter is not None and a.adapter not in inst.adapters:
        return "adapter_unavailable", f"adapter {a.adapter!r} is not registered for {a.model} on {worker_id}"
    if a.request_id in active:
        other = active[a.request_id].key
        return "no_capacity", f"request {a.request_id} already runs here (assignment {other})"
    total = len(a.prompt_token_ids) + len(a.resume_token_ids)
    if len(a.resume_token_ids) >= a.sampling.max_tokens:
        raise BadRequest(f"{len(a.resume_token_ids)} resume tokens leave nothing of max_tokens "
                         f"{a.sampling.max_tokens} to generate", field="resume_token_ids")
    if total >= inst.max_model_len:
        raise BadRequest(f"prompt and resumed tokens ({total}) reach the context length {inst.max_model_len} "
                         f"of {a.model}", field="prompt_token_ids")
    vocab = inst.vocab_size
    if any(t >= vocab for t in a.prompt_token_ids) or any(t >= vocab for t in a.resume_token_ids):
        raise BadRequest(f"token ids must be below the vocabulary size {vocab} of {a.model}", field="prompt_token_ids")
    snap = inst.snapshot
    if snap.waiting + inst.pending >= max_waiting:
        return "no_capacity", f"instance {inst.instance_id} has {max_waiting} requests waiting"
    blocks_needed = -(-total // inst.engine.blocks.block_size) * inst.num_layers
    if snap.kv_blocks_total and blocks_needed > snap.kv_blocks_total:
        return "no_capacity", f"{total} tokens need {blocks_needed} KV blocks; {inst.instance_id} has {snap.kv_blocks_total}"
    return None


def adapter_users(active: Mapping[str, Active]) -> dict[str, int]:
    """Requests admitted here per adapter they name (what an `OffloadAdapter` is refused `busy` on); the
    stats carry it so the planner offers only adapters nobody uses."""
    out: dict[str, int] = {}
    for entry in active.values():
        name = entry.assignment.adapter
        if name:
            out[name] = out.get(name, 0) + 1
    return out
