"""Admission: which instances may serve a request, and which have room for it right now.

Pure: no I/O, no clock reads. The dispatcher holds a request in its admission queue while
no instance has room (KunServe §4.3: a maximum batch per instance, so an instance whose
memory could hold more still does not queue work it cannot compute in time), and hands
the instances that do have room to the `RoutingPolicy`, which picks one. Keeping "may it
go there" (capability and room) apart from "where is best" (the routing policy) lets later
policies reuse the same gate.
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.routing import AdapterGate, InstanceView, RequestView, can_host, candidates


def adapter_gate(policy: object) -> AdapterGate:
    """The candidate rule a routing policy asks for (its `adapter_gate`; default resident_first)."""
    return getattr(policy, "adapter_gate", "resident_first")


def serving(request: RequestView, instances: Sequence[InstanceView],
            gate: AdapterGate = "resident_first") -> list[InstanceView]:
    """Live instances able to serve the request at all (its model; its adapter, if any).

    For an adapter request, only instances that have the adapter registered are candidates
    (`InstanceView.adapters`; when unknown, every instance of the base model: a worker without
    it rejects the assignment with `adapter_unavailable` and the dispatcher moves on). Then, by
    `gate` (the policy's, `adapter_gate(policy)`): "resident_first" keeps the instances where
    the adapter is resident when any is; "hostable" keeps every instance where it is resident
    or that has room to load it (`can_host`), and the policy prices the load (rank-aware).
    """
    able = candidates(request, instances)
    if request.adapter is None:
        return able
    if gate == "hostable":
        return [inst for inst in able if can_host(request, inst)]
    resident = [inst for inst in able if request.adapter in inst.resident_adapters]
    return resident or able


def batch_load(instance: InstanceView) -> int:
    """Requests the instance holds: in the batch plus waiting for it."""
    return instance.running_requests + instance.waiting_requests


def has_room(request: RequestView, instance: InstanceView) -> bool:
    """Below its maximum batch, and (unless idle) enough free KV for the request's prompt."""
    load = batch_load(instance)
    if load >= instance.max_batch:
        return False
    if load == 0:
        return True  # an idle instance takes anything `candidates` let through
    free = instance.kv_tokens_total - instance.outstanding_tokens
    return free >= request.prompt_tokens


def with_room(request: RequestView, instances: Sequence[InstanceView],
              gate: AdapterGate = "resident_first") -> list[InstanceView]:
    """The instances that may serve the request (by `gate`) and have room for it now."""
    return [inst for inst in serving(request, instances, gate) if has_room(request, inst)]


__all__ = ["adapter_gate", "batch_load", "has_room", "serving", "with_room"]
