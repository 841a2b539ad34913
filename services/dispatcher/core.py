"""The dispatcher's decisions, as a pure state machine: messages and time in, effects out.

It owns the requests this dispatcher admitted (`TrackedRequest`), the per-model admission
queues, the live instance view and the assignment record. The actor (`actor.py`) feeds it
bus messages and the outcome of every Assignment and performs the effects it returns; no
method here does I/O or reads a clock. Where to send a request is the routing policy's
choice (`shared.policy.routing`); whether an instance may take it now is the admission
gate's (`shared.policy.admission`). See docs/serving.md for the flow and re-dispatch rules.
"""
from __future__ import annotations

from collections import deque

import msgspec

from shared.events import (
    AbortRequest, AssignAccepted, AssignRejected, CatalogChanged, DispatchStats, PlacementHints, StreamError,
    StreamMessage, StreamReassigned, SubmitAccepted, SubmitRejected, SubmitReply, SubmitRequest,
    WorkerHeartbeat, WorkerRecord, WorkerStats,
)
from shared.events.registry import AdapterRecord, Bucket, GroupRecord, ModelRecord
from shared.logging import get_logger
from shared.policy.admission import adapter_gate, batch_load, serving, with_room
from shared.policy.routing import RoutingPolicy
from shared.policy.routing_groups import GroupBatch, summed_batch

from services.dispatcher.admission_queue import AdmissionQueues
from services.dispatcher.cold_start import CapacityAsks, cold_queue_full_message
from services.dispatcher.drain_rate import DrainRate
from services.dispatcher.effects import (
    AssignFailed, AssignmentRecord, AssignOutcome, Effect, PublishStreamError,
    SendAssignment,
)
from services.dispatcher.instance_table import InstanceTable, WorkerLost
from services.dispatcher.load_counters import LoadCounters
from services.dispatcher.model_catalog import ModelCatalog
from services.dispatcher.prefix_score import PrefixRouter
from services.dispatcher.queue_expiry import QueueExpiry
from services.dispatcher.stream_fence import fence, stop_stale_copy, stream_error
from services.dispatcher.tracked import Phase, TrackedRequest

log = get_logger("tidal.dispatcher")

# How long an instance that turned a request away is skipped for that request, by reason.
AVOID_S = {"no_capacity": 0.5, "draining": 3600.0, "model_not_loaded": 60.0, "adapter_unavailable": 60.0,
           "no_responders": 2.0, "error": 60.0, "silent": 30.0}
MAX_ASSIGN_TIMEOUTS = 3  # lost replies in a row before the worker is given up on for that request
MAX_TRACKED = 100_000  # requests owned at once (queued + running), whatever the queue bounds say
RECORD_KEEP = 10_000  # assignment records kept in memory


class DispatchCore:
    def __init__(self, *, dispatcher_id: str, policy: RoutingPolicy, catalog: ModelCatalog, queue_bound: int,
                 max_redispatches: int, dead_after: float, block_size: int, max_batch: int, now: float,
                 scale_from_zero: bool = False, group_batch: GroupBatch = summed_batch, prefix: PrefixRouter | None = None) -> None:
        self.dispatcher_id, self.prefix = dispatcher_id, prefix  # prefix-aware routing (prefix_score.py); None: off
        self.capacity = CapacityAsks(scale_from_zero)  # cold models: queue and ask the planner (cold_start.py)
        self.policy = policy
        self.catalog = catalog
        self.max_redispatches = max_redispatches
        self.queues = AdmissionQueues(queue_bound)
        self.table = InstanceTable(dead_after=dead_after, block_size=block_size, max_batch=max_batch,
                                   group_batch=group_batch)
        self.requests: dict[str, TrackedRequest] = {}
        self.records: deque[AssignmentRecord] = deque(maxlen=RECORD_KEEP)
        self.counters = LoadCounters(dispatcher_id, now)
        self.drain = DrainRate()  # how fast each queue empties: the Retry-After of a refusal
        self.expiry = QueueExpiry()  # queued requests that give up waiting (queue_expiry.py)
        self.draining = False
        self.redispatches = 0  # totals, for metrics
        self.stream_errors = 0

    # --- submit ---------------------------------------------------------------------------
    def submit(self, msg: SubmitRequest, now: float) -> tuple[SubmitReply, list[Effect]]:
        rid = msg.request_id
        known = self.requests.get(rid)
        if known is not None:  # the same submit again (a retried request): answer as before
            return self._accepted(known), []
        refusal = self._refuse(msg, now)
        if refusal is None:
            req = TrackedRequest(submit=msg, admitted_ts=now, queued_ts=now)
            effects: list[Effect] = []
            if not self.queues.size(msg.model):
                effect = self._place(req, now)
                effects = [] if effect is None else [effect]
            if effects or not self.queues.full(msg.model):
                self.requests[rid] = req
                self.counters.arrival(msg.model, msg.adapter, len(msg.prompt_token_ids), admitted=True)
                if not effects:  # behind others, or no room now: in line, and the line moves if it can
                    self.queues.push(req)
                    self.drain.queued(msg.model, now)
                    effects = self.drain_queue(msg.model, now) + self._ask_if_cold(msg.model, msg.adapter, now)
                return self._accepted(req), effects
            if not self.table.views(msg.model, now):  # waiting for an instance to start: 503, not 429
                refusal = SubmitRejected(request_id=rid, reason="no_capacity", retry_after_s=self._retry_after(msg.model, now),
                                         message=cold_queue_full_message(msg.model, self.queues.bound))
            else:
                refusal = SubmitRejected(
                    request_id=rid, reason="queue_full", retry_after_s=self._retry_after(msg.model, now),
                    message=f"the queue of {msg.model!r} is full ({self.queues.bound} waiting); retry later",
                )
        if refusal.reason != "model_not_found":  # per-model load of real models only (names are the client's)
            self.counters.arrival(msg.model, msg.adapter, len(msg.prompt_token_ids), admitted=False)
        return refusal, []

    def _refuse(self, msg: SubmitRequest, now: float) -> SubmitRejected | None:
        rid = msg.request_id
        if self.draining:
            return SubmitRejected(request_id=rid, reason="draining", retry_after_s=1.0,
                                  message="this dispatcher is shutting down; retry")
        served = self.table.served_models(now)
        refusal = self.catalog.check(msg.model, msg.adapter, len(msg.prompt_token_ids), msg.sampling.max_tokens, served)
        if refusal is not None:
            return SubmitRejected(request_id=rid, reason=refusal.reason, message=refusal.message)  # type: ignore[arg-type]
        view = TrackedRequest(submit=msg, admitted_ts=now).view()
        instances = self.table.views(msg.model, now)
        if not instances and self.capacity.enabled:
            pass  # no instance at all: queued while the planner starts one (cold_start.py)
        elif not serving(view, instances):
            what = f"{msg.model!r}" + (f" with adapter {msg.adapter!r}" if msg.adapter else "")
            return SubmitRejected(request_id=rid, reason="no_capacity", retry_after_s=self.table.dead_after,
                                  message=f"no live instance can serve {what} now")
        if len(self.requests) >= MAX_TRACKED:
            return SubmitRejected(request_id=rid, reason="no_capacity", retry_after_s=1.0,
                                  message="this dispatcher holds its maximum number of requests")
        return None

    def _accepted(self, req: TrackedRequest) -> SubmitAccepted:
        if req.phase is Phase.QUEUED:
            return SubmitAccepted(request_id=req.request_id, queue_position=self.queues.position(req.request_id))
        return SubmitAccepted(request_id=req.request_id, worker_id=req.worker_id, instance_id=req.instance_id)

    def _retry_after(self, model: str, now: float) -> float:
        """When the requests queued ahead are likely served, from the queue's measured drain rate."""
        order = self.queues.in_order(model)
        head = self.requests.get(order[0]) if order else None
        head_wait = now - head.queued_ts if head is not None and head.queued_ts else 0.0
        ahead = sum(self.drain.expected_tokens(model, r.submit.sampling.max_tokens)
                    for r in map(self.requests.get, order) if r is not None)
        return self.drain.retry_after(model, len(order), now, head_wait, tokens_ahead=ahead,
                                      tokens_per_s=self.table.tokens_per_s(model, now))

    # --- placement ------------------------------------------------------------------------
    def _place(self, req: TrackedRequest, now: float) -> SendAssignment | None:
        """Route `req` to an instance with room (the policy picks), or None to keep it queued."""
        view = req.view()
        if view.adapter is not None:  # rank and size: what rank-aware routing and hosting checks need
            rank, nbytes = self.catalog.adapter_size(view.adapter)
            view = msgspec.structs.replace(view, adapter_rank=rank, adapter_bytes=nbytes)
        room = [inst for inst in with_room(view, self.table.views(req.model, now), adapter_gate(self.policy))
                if not req.avoided(inst.instance_id, now)]
        if not room:
            return None
        chosen = self.prefix.choose(req.submit, view, room, now) if self.prefix else self.policy.choose(view, room, now)
        target = next((inst for inst in room if inst.instance_id == chosen), None)
        if target is None:
            return None
        key = req.next_key()
        req.phase, req.pending_key, req.timeouts = Phase.ASSIGNING, key, 0
        req.worker_id, req.instance_id = target.worker_id, target.instance_id
        req.abandoned.discard(target.worker_id)  # back on a worker given up on before: follow it again
        req.incarnation = self.table.incarnation(target.worker_id)
        self.table.assigned(target.instance_id, req.request_id, req.prefill_tokens, view.adapter_rank)
        self.records.append(AssignmentRecord(
            ts=now, request_id=req.request_id, attempt=req.attempt, idempotency_key=key, worker_id=target.worker_id,
            instance_id=target.instance_id, resumed_tokens=len(req.emitted), owner=self.dispatcher_id,
        ))
        return SendAssignment(target.worker_id, req.assignment(target.instance_id, key))

    def _unassign(self, req: TrackedRequest) -> None:
        self.table.released(req.instance_id, req.request_id)
        req.phase, req.pending_key = Phase.QUEUED, None
        req.worker_id = req.instance_id = req.incarnation = None

    def _requeue(self, req: TrackedRequest, now: float) -> None:
        """Back in line; the bound does not apply (it was admitted already)."""
        self._unassign(req)
        req.queued_ts = now
        if req.request_id not in self.queues:
            self.queues.push(req)

    def drain_queue(self, model: str, now: float) -> list[Effect]:
        """Assign queued requests of `model` while instances have room (queue order)."""
        effects: list[Effect] = []
        if not self._batch_room(model, now):
            return effects
        for rid in self.queues.in_order(model):
            req = self.requests.get(rid)
            if req is None:
                continue
            effect = self._place(req, now)
            if effect is not None:
                self.queues.remove(req)
                self.drain.left(model, now)
                effects.append(effect)
            elif not self._batch_room(model, now):
                break  # every instance is at its maximum batch: later requests cannot go either
        return effects

    def _batch_room(self, model: str, now: float) -> bool:
        return any(batch_load(inst) < inst.max_batch for inst in self.table.views(model, now))

    def drain_all(self, now: float) -> list[Effect]:
        return [e for model in self.queues.models() for e in self.drain_queue(model, now)]

    # --- assignment outcomes --------------------------------------------------------------
    def assign_outcome(self, request_id: str, key: str, outcome: AssignOutcome, now: float) -> list[Effect]:
        req = self.requests.get(request_id)
        if req is None or req.pending_key != key:
            return []  # aborted, finished, or superseded by a later attempt meanwhile
        if isinstance(outcome, AssignAccepted):
            req.phase, req.pending_key, req.timeouts = Phase.RUNNING, None, 0
            return []
        instance = req.instance_id or ""
        if isinstance(outcome, AssignFailed) and outcome.kind == "timeout":
            req.timeouts += 1
            if req.timeouts < MAX_ASSIGN_TIMEOUTS and req.worker_id is not None:
                # The worker may have taken it: ask again with the same key (applied once).
                return [SendAssignment(req.worker_id, req.assignment(instance, key))]
            req.avoid[instance] = now + AVOID_S["silent"]  # alive maybe, but not answering us
            return self._lost_on(req, f"no reply to {MAX_ASSIGN_TIMEOUTS} assignments", now)
        reason = outcome.reason if isinstance(outcome, AssignRejected) else outcome.kind
        if reason == "draining" and req.worker_id:
            self.table.draining(req.worker_id)
        req.avoid[instance] = now + AVOID_S.get(reason, 1.0)
        self._unassign(req)
        effect = self._place(req, now)  # another instance, at once
        if effect is None:
            self._requeue(req, now)
            return []
        return [effect]

    # --- streams --------------------------------------------------------------------------
    def stream(self, msg: StreamMessage, now: float) -> list[Effect]:
        req = self.requests.get(msg.request_id)
        if req is None or isinstance(msg, StreamReassigned):
            return []  # not ours, or our own fence heard back
        if msg.worker_id is not None and msg.attempt < req.attempt:
            return stop_stale_copy(req, msg.worker_id, now)  # from an assignment we gave up on: fenced out
        if msg.worker_id is not None and not req.current(msg.attempt, msg.handover, msg.seq):
            return []  # a migration's source past its hand-over (it handed the stream on): fenced out
        if isinstance(msg, StreamError):
            self._forget(req)  # someone ended it (a worker, or another copy of us)
            return self.drain_queue(req.model, now)
        worker = msg.worker_id
        if worker is not None and worker in req.abandoned:
            return []  # a late chunk from a worker we gave up on; its replacement carries the stream
        if worker is not None and worker != req.worker_id and req.phase is Phase.RUNNING:
            self._moved(req, worker)  # migrated by a plan: follow it
        if req.phase is Phase.ASSIGNING and worker == req.worker_id:
            req.phase, req.pending_key = Phase.RUNNING, None  # its chunks prove it was accepted
        if not req.record_chunk(msg):
            log.warning("stream tracking lost order; the request can no longer be re-dispatched", request_id=req.request_id)
            req.early.clear()
        if msg.final:
            self.counters.completion(req.model, req.submit.adapter, msg.usage.completion_tokens if msg.usage else 0)
            self.drain.finished(req.model, msg.usage.completion_tokens if msg.usage else len(req.emitted))
            self._forget(req)
            return self.drain_queue(req.model, now)
        return []

    def returned(self, worker_id: str, now: float) -> list[Effect]:
        """A worker we lost is heard from again, same process (`restarted: false`): it may still run
        copies of requests we re-dispatched meanwhile; each is told to stop."""
        return [e for req in list(self.requests.values())
                if worker_id in req.abandoned and req.worker_id != worker_id
                for e in stop_stale_copy(req, worker_id, now)]

    def _moved(self, req: TrackedRequest, worker: str) -> None:
        self.table.released(req.instance_id, req.request_id)
        req.worker_id = worker
        req.instance_id = self.table.instance_on(worker, req.model)
        req.incarnation = self.table.incarnation(worker)
        if req.instance_id:
            rank = self.catalog.adapter_size(req.submit.adapter)[0] if req.submit.adapter else 0
            self.table.assigned(req.instance_id, req.request_id, 0, rank)

    def abort(self, msg: AbortRequest, now: float) -> list[Effect]:
        """The client went away: a queued request is dropped; a running one its worker stops."""
        req = self.requests.get(msg.request_id)
        if req is None or msg.targeted:  # a targeted one stops a superseded copy only: the request goes on
            return []
        self._forget(req)
        return self.drain_queue(req.model, now)

    def _forget(self, req: TrackedRequest) -> None:
        self.requests.pop(req.request_id, None)
        self.queues.remove(req)
        self.table.released(req.instance_id, req.request_id)

    # --- workers --------------------------------------------------------------------------
    def worker_stats(self, msg: WorkerStats, now: float) -> list[Effect]:
        was_lost = self.table.is_lost(msg.worker_id)
        effects = [e for model in self.table.stats(msg, now) for e in self.drain_queue(model, now)]
        return (self.returned(msg.worker_id, now) + effects) if was_lost else effects

    def heartbeat(self, msg: WorkerHeartbeat, now: float) -> list[Effect]:
        was_lost = self.table.is_lost(msg.worker_id)
        lost = self.table.heartbeat(msg, now)
        if lost:
            return self._handle_lost(lost, now)
        return self.returned(msg.worker_id, now) if was_lost else []

    def placement_hints(self, msg: PlacementHints, now: float) -> bool:
        """The planner's placement for new requests of a model; kept by a policy that routes by it
        (`mell`), ignored by the others. False when ignored or older than the hints held."""
        take = getattr(self.policy, "take_hints", None)
        return bool(take(msg)) if take is not None else False

    def catalog_changed(self, event: CatalogChanged, now: float) -> list[Effect]:
        record = event.record
        if event.bucket is Bucket.WORKERS and isinstance(record, WorkerRecord):
            lost = self.table.record(record, now)
            return self._handle_lost(lost, now) if lost else []
        if event.bucket is Bucket.GROUPS:  # a buddy group being restored takes nothing new (KunServe §4.3)
            if isinstance(record, GroupRecord) and record.state == "restoring":
                self.table.restoring_groups.add(record.group_id)
            else:
                self.table.restoring_groups.discard(event.key)
        if event.bucket is Bucket.MODELS:
            if isinstance(record, ModelRecord):
                self.catalog.put_model(record)
            elif event.op == "delete":
                self.catalog.delete_model(event.key)
        elif event.bucket is Bucket.ADAPTERS:
            if isinstance(record, AdapterRecord):
                self.catalog.put_adapter(record)
            elif event.op == "delete":
                self.catalog.delete_adapter(event.key)
        return []

    def _handle_lost(self, lost: WorkerLost, now: float) -> list[Effect]:
        victims = [r for r in self.requests.values()
                   if r.worker_id == lost.worker_id and r.phase is not Phase.QUEUED
                   and (lost.incarnation is None or r.incarnation is None or r.incarnation == lost.incarnation)]
        if victims:
            log.warning("worker lost; re-dispatching its requests", worker_id=lost.worker_id, why=lost.why,
                        requests=len(victims))
        effects: list[Effect] = []
        for req in victims:
            effects += self._lost_on(req, f"worker {lost.worker_id} lost ({lost.why})", now)
        return effects

    def _lost_on(self, req: TrackedRequest, why: str, now: float) -> list[Effect]:
        """The worker running `req` is gone: re-dispatch it (resuming), or end it past the limit."""
        lost_worker = req.worker_id or ""
        if req.attempt >= self.max_redispatches:
            self._forget(req)
            self.stream_errors += 1
            return [stream_error(req, "redispatch_limit",
                                 f"{why}; the request was re-dispatched {req.attempt} times already (the limit)")]
        req.new_attempt(lost_worker)
        self.redispatches += 1
        log.info("re-dispatching", request_id=req.request_id, attempt=req.attempt, resume_tokens=len(req.emitted),
                 next_seq=req.next_seq, why=why)
        self._requeue(req, now)
        # The fence goes out before the new attempt's Assignment: from next_seq on the stream is its.
        return [fence(req, lost_worker), *self.drain_queue(req.model, now)]

    def _ask_if_cold(self, model: str, adapter: str | None, now: float) -> list[Effect]:
        """Ask the planner for an instance of `model` if none is live and requests wait for it."""
        if self.table.views(model, now) or not self.queues.size(model):
            self.capacity.served(model)
            return []
        return list(self.capacity.ask(model, adapter, self.queues.size(model), self.queues.queued_prompt_tokens(model),
                                      now))

    # --- time -----------------------------------------------------------------------------
    def tick(self, now: float) -> list[Effect]:
        """Lose silent workers, expire queued requests, retry queues, ask for cold models again."""
        effects: list[Effect] = []
        for lost in self.table.expire(now):
            effects += self._handle_lost(lost, now)
        effects += self._expire_queued(now)
        for model in self.queues.models():
            effects += self._ask_if_cold(model, None, now)
        return effects + self.drain_all(now)

    def _expire_queued(self, now: float) -> list[Effect]:
        gone = self.expiry.expired(self.queues, self.requests, lambda m: bool(self.table.views(m, now)), now)
        return [self._fail_queued(req, why) for req, why in gone]

    def _fail_queued(self, req: TrackedRequest, why: str) -> PublishStreamError:
        self._forget(req)
        self.stream_errors += 1
        return stream_error(req, "queue_timeout", f"not scheduled: {why}")

    def fail_all_queued(self, why: str) -> list[Effect]:
        """At shutdown: end every queued request's stream (its client should retry)."""
        return [self._fail_queued(self.requests[rid], why)
                for model in self.queues.models() for rid in self.queues.in_order(model)]

    def take_stats(self, now: float) -> DispatchStats:
        queued = {m: (self.queues.size(m), self.queues.queued_prompt_tokens(m)) for m in self.queues.models()}
        return self.counters.take(now, queued)

    # --- reading --------------------------------------------------------------------------
    def count(self, phase: Phase) -> int:
        return sum(1 for r in self.requests.values() if r.phase is phase)
