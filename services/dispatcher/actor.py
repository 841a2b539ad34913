"""The dispatcher actor: bus messages into the pure core, the core's effects onto the bus.

Subscriptions: `dispatch.submit` (queue group `dispatcher`), worker stats and heartbeats,
every request's out and abort subjects (wildcards: each dispatcher follows only the
requests it admitted), and the registry's worker/model/adapter changes (a background watch
that retries while the registry is away; the config and worker stats suffice meanwhile).
Assignments are sent from tasks outside the mailbox, so a slow worker never holds up
admission; each reply comes back into the core through a mailbox turn.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import time

from shared.actors import Actor
from shared.bus import Delivery, Subscription
from shared.config import ClusterConfig
from shared.events import (
    AbortRequest, AssignAccepted, AssignRejected, AssignReply, PlacementHints, PrefixSummary, StreamMessage,
    SubmitAccepted, SubmitReply, SubmitRequest, WorkerHeartbeat, WorkerStats,
)
from shared.events.registry import Bucket
from shared.logging import get_logger, request_id_var
from shared.lora_profile_file import routing_options
from shared.policy.routing_policies import make_policy
from shared.policy.routing_groups import GroupBatch, profiled_batch, summed_batch
from shared.policy.routing_mell import OUTCOMES
from shared.profiles import load_pipeline_profile
from shared.registry_client import CatalogWatch, RegistryClient
from shared.service import Service
from shared.events.plan import CapacityReply, CapacityRequest
from shared.subjects import (
    CATALOG, planner_capacity, dispatch_stats, dispatch_submit, planner_placement, request_abort, request_out,
    worker_assign, worker_heartbeat, worker_prefixes, worker_stats,
)
from shared.wire import (
    DEADLINE_EXCEEDED, UNAVAILABLE, DeadlineExceeded, NoResponders, RemoteError, TidalError, Unavailable,
)

from services.dispatcher import metrics
from services.dispatcher.core import DispatchCore
from services.dispatcher.effects import (
    AssignFailed, AssignOutcome, Effect, PublishAbort, PublishFence, PublishStreamError, RequestCapacity,
    SendAssignment,
)
from services.dispatcher.model_catalog import ModelCatalog
from services.dispatcher.prefix_index import PrefixIndex
from services.dispatcher.prefix_score import PrefixRouter
from services.dispatcher.tracked import Phase

log = get_logger("tidal.dispatcher")

TICK_S = 0.1  # liveness, queue deadlines, retries of queued requests
WATCHED = (Bucket.WORKERS, Bucket.MODELS, Bucket.ADAPTERS, Bucket.GROUPS)


def group_batch(cfg: ClusterConfig) -> GroupBatch:
    """A buddy group's batch limit (§4.3) from KunServe's pipeline profile; without buddy groups none form."""
    if not cfg.policies.buddy_groups:
        return summed_batch
    return profiled_batch(load_pipeline_profile(cfg.policies.kunserve_profile))


class Dispatcher(Actor):
    def __init__(self, cfg: ClusterConfig, dispatcher_id: str) -> None:
        super().__init__("dispatcher")
        d = cfg.dispatcher
        policy = make_policy(d.routing_policy.replace("_", "-"), options=routing_options(cfg))
        self.core = DispatchCore(
            dispatcher_id=dispatcher_id, policy=policy,
            prefix=PrefixRouter(policy, PrefixIndex(), weight=d.prefix_weight) if d.prefix_routing else None,
            catalog=ModelCatalog.from_config(cfg), queue_bound=d.queue_bound, max_redispatches=d.max_redispatches,
            dead_after=float(cfg.registry.dead_after), block_size=cfg.policies.kv_block_tokens,
            max_batch=cfg.policies.max_batch_size, now=time.time(), scale_from_zero=d.scale_from_zero,
            group_batch=group_batch(cfg),
        )
        self.assign_timeout = float(d.assign_timeout)
        self.stats_interval = float(d.stats_interval)
        self._sends: set[asyncio.Task[None]] = set()
        self._submit_sub: Subscription | None = None
        for phase in Phase:
            metrics.OWNED.labels(str(phase)).set_function(functools.partial(self.core.count, phase))
        if self.core.prefix is not None:
            for outcome in ("prefix", "load"):
                metrics.PREFIX_ROUTES.labels(outcome).set_function(functools.partial(self.core.prefix.counts.__getitem__, outcome))
        counts = getattr(self.core.policy, "counts", None)  # `mell` routing: hinted, or why it fell back
        if getattr(self.core.policy, "take_hints", None) is not None and counts is not None:
            for outcome in OUTCOMES:
                metrics.HINT_ROUTES.labels(outcome).set_function(functools.partial(counts.__getitem__, outcome))

    async def on_start(self) -> None:
        await self.bind(worker_stats(), WorkerStats, self.on_worker_stats)
        await self.bind(worker_heartbeat(), WorkerHeartbeat, self.on_heartbeat)
        if self.core.prefix is not None:  # prefix-aware routing: the instances' cached prefixes
            await self.bind(worker_prefixes(), PrefixSummary, self.on_prefix_summary)
        if getattr(self.core.policy, "take_hints", None) is not None:  # `mell` routing follows the planner
            await self.bind(planner_placement(), PlacementHints, self.on_placement_hints)
        out, abort = CATALOG["request.out"].wildcard, CATALOG["request.abort"].wildcard
        await self.bind(out, StreamMessage, self.on_stream, label=out)
        await self.bind(abort, AbortRequest, self.on_abort, label=abort)
        self._submit_sub = await self.bind(dispatch_submit(), SubmitRequest, self.on_submit, queue="dispatcher")
        self.spawn("tick", self._tick_loop)
        self.spawn("stats", self._stats_loop)
        for bucket in WATCHED:
            self.spawn(f"watch-{bucket}", functools.partial(self._watch, bucket))

    async def on_stop(self) -> None:
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)

    # --- handlers (the mailbox: one at a time) --------------------------------------------
    async def on_submit(self, msg: SubmitRequest, _ctx: Delivery) -> SubmitReply:
        reply, effects = self.core.submit(msg, time.time())
        if isinstance(reply, SubmitAccepted):
            metrics.SUBMITS.labels("queued" if reply.worker_id is None else "assigned").inc()
        else:
            metrics.SUBMITS.labels(reply.reason).inc()
            log.info("submit rejected", request_id=msg.request_id, reason=reply.reason, model=msg.model)
        await self._perform(effects)
        return reply

    async def on_worker_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        await self._perform(self.core.worker_stats(msg, time.time()))

    async def on_heartbeat(self, msg: WorkerHeartbeat, _ctx: Delivery) -> None:
        await self._perform(self.core.heartbeat(msg, time.time()))

    async def on_prefix_summary(self, msg: PrefixSummary, _ctx: Delivery) -> None:
        if self.core.prefix is not None:
            self.core.prefix.index.take(msg, time.time())

    async def on_placement_hints(self, msg: PlacementHints, _ctx: Delivery) -> None:
        self.core.placement_hints(msg, time.time())

    async def on_stream(self, msg: StreamMessage, _ctx: Delivery) -> None:
        await self._perform(self.core.stream(msg, time.time()))

    async def on_abort(self, msg: AbortRequest, _ctx: Delivery) -> None:
        await self._perform(self.core.abort(msg, time.time()))

    # --- effects --------------------------------------------------------------------------
    async def _perform(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SendAssignment):
                # A fresh context: the Assignment's deadline is its own, not the submit's.
                task = asyncio.get_running_loop().create_task(self._send(effect), context=contextvars.Context())
                self._sends.add(task)
                task.add_done_callback(self._sends.discard)
            elif isinstance(effect, PublishStreamError):
                error = effect.error
                metrics.STREAM_ERRORS.labels(error.code).inc()
                log.warning("stream ended by the dispatcher", request_id=error.request_id, code=error.code,
                            error=error.message)
                try:
                    await self.bus.publish(request_out(error.request_id), error)
                except Exception as exc:  # NATS away: the client times out instead
                    log.warning("stream error not published", request_id=error.request_id, error=repr(exc))
            elif isinstance(effect, PublishFence):
                fence = effect.fence
                try:
                    await self.bus.publish(request_out(fence.request_id), fence)
                except Exception as exc:  # NATS away: the new attempt's first chunk fences the stream instead
                    log.warning("stream fence not published", request_id=fence.request_id, error=repr(exc))
            elif isinstance(effect, PublishAbort):
                abort = effect.abort
                log.info("telling a worker given up on to stop its stale copy", request_id=abort.request_id,
                         worker_id=abort.worker_id, attempt=abort.attempt)
                try:
                    await self.bus.publish(request_abort(abort.request_id), abort)
                except Exception as exc:  # its chunks are fenced out anyway; it ends at its own deadline
                    log.warning("stale-copy abort not published", request_id=abort.request_id, error=repr(exc))
            elif isinstance(effect, RequestCapacity):  # a cold model: ask the planner (answered off the mailbox)
                task = asyncio.get_running_loop().create_task(self._ask_capacity(effect), context=contextvars.Context())
                self._sends.add(task)
                task.add_done_callback(self._sends.discard)

    async def _ask_capacity(self, effect: RequestCapacity) -> None:
        ask = CapacityRequest(dispatcher_id=self.core.dispatcher_id, model=effect.model, adapter=effect.adapter,
                              queued_requests=effect.queued_requests, queued_prompt_tokens=effect.queued_prompt_tokens,
                              ts=time.time())
        try:
            reply = await self.bus.request(planner_capacity(), ask, CapacityReply, timeout=self.assign_timeout)
        except TidalError as exc:  # no planner, or it did not answer: asked again while requests wait
            metrics.CAPACITY_ASKS.labels("unanswered").inc()
            log.warning("capacity request unanswered", model=effect.model, error=str(exc))
            return
        metrics.CAPACITY_ASKS.labels(reply.outcome).inc()
        log.info("capacity requested", model=effect.model, queued=effect.queued_requests, outcome=reply.outcome,
                 plan_id=reply.plan_id)

    async def _send(self, effect: SendAssignment) -> None:
        a = effect.assignment
        request_id_var.set(a.request_id)
        if a.attempt and a.idempotency_key == f"{a.request_id}:{a.attempt}":
            metrics.REDISPATCHES.inc()  # the first send of a re-dispatch
        started = time.perf_counter()
        outcome: AssignOutcome
        try:
            outcome = await self.bus.request(worker_assign(effect.worker_id), a, AssignReply, timeout=self.assign_timeout)
            metrics.ASSIGN_SECONDS.observe(time.perf_counter() - started)
        except NoResponders:
            outcome = AssignFailed("no_responders")
        except DeadlineExceeded:
            outcome = AssignFailed("timeout")
        except Unavailable as exc:  # not sent (NATS away): it cannot have been taken
            outcome = AssignFailed("no_responders", str(exc))
        except RemoteError as exc:  # the worker refused to handle it (expired, undecodable, ...): not taken
            kind = "no_responders" if exc.code in (DEADLINE_EXCEEDED, UNAVAILABLE) else "error"
            outcome = AssignFailed(kind, str(exc))
        except TidalError as exc:
            outcome = AssignFailed("error", str(exc))
        label = ("accepted" if isinstance(outcome, AssignAccepted)
                 else outcome.reason if isinstance(outcome, AssignRejected) else outcome.kind)
        metrics.ASSIGNMENTS.labels(label).inc()
        if label != "accepted":
            log.info("assignment not accepted", worker_id=effect.worker_id, instance_id=a.instance_id, outcome=label,
                     attempt=a.attempt)
        async with self.turn():
            effects = self.core.assign_outcome(a.request_id, a.idempotency_key, outcome, time.time())
        await self._perform(effects)

    # --- background -----------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            async with self.turn():
                effects = self.core.tick(now := time.time())
                if self.core.prefix is not None:
                    self.core.prefix.index.expire(now)
            await self._perform(effects)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval)
            async with self.turn():
                stats = self.core.take_stats(time.time())
            try:
                await self.bus.publish(dispatch_stats(), stats)
            except Exception as exc:
                log.warning("dispatch stats not published", error=repr(exc))

    async def _watch(self, bucket: Bucket) -> None:
        """Follow a registry bucket; while the registry is unreachable, retry with backoff."""
        client = RegistryClient(self.bus, timeout=2.0)
        backoff, complained = 0.25, False
        while True:
            watch = CatalogWatch(client, bucket)
            try:
                await watch.start()
            except (TidalError, OSError) as exc:
                await watch.stop()
                if not complained:
                    log.warning("registry unreachable; routing from the config and worker stats meanwhile",
                                bucket=str(bucket), error=str(exc))
                    complained = True
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            if complained:
                log.info("registry reachable again", bucket=str(bucket))
            try:
                async for event in watch:
                    async with self.turn():
                        effects = self.core.catalog_changed(event, time.time())
                    await self._perform(effects)
            finally:
                await watch.stop()

    # --- shutdown -------------------------------------------------------------------------
    async def drain(self, service: Service) -> None:
        """SIGTERM: stop taking submits (the queue group's other members get them), give queued
        requests until half the drain deadline to be scheduled, then end their streams."""
        async with self.turn():
            self.core.draining = True
        if self._submit_sub is not None:
            await self.unbind(self._submit_sub)
        deadline = time.monotonic() + service.settings.drain_timeout_s / 2
        while time.monotonic() < deadline and (len(self.core.queues) or self.core.count(Phase.ASSIGNING)):
            await asyncio.sleep(0.05)
        async with self.turn():
            effects = self.core.fail_all_queued("the dispatcher stopped before the request was scheduled; retry")
        await self._perform(effects)
