"""The live planner: worker stats, liveness and the catalog in; every `[planner] interval` a
ClusterView through the pure PlannerCore; plan events and ctl commands out; outcomes back in.

State (latest stats per worker, dead workers, catalog, the core) is this actor's: it changes in
its handlers and, in the background tasks, only inside `self.turn()`. Effects are applied by
tasks of their own (a migration is answered when it is over), so a slow command never holds up
the next interval; their outcomes come back through the mailbox. Only the lease holder decides
(services/planner/lease.py); with `[planner] enabled = false` nothing is decided at all and an
external scheduler drives the same ctl commands (docs/subjects.md). After each step the leader
also publishes the policies' placement hints (`tidal.v1.evt.planner.placement`) for the
dispatcher's `mell` routing.

Capacity requests (`tidal.v1.planner.capacity`, queue group `planner`): a dispatcher holds requests
for a model with no live instance; the leader decides a ScaleUp through the core
(shared/planner/scale_up.py: prefer a worker holding the model warm), applies it (LoadModel) and
answers `planned` with its plan id at once — or with the plan id of a start of the model already in
flight (either path, until its instance is in the stats); a standby, a disabled planner or no room
answers `none`.

`[planner] economy = "arbiter"`: the core runs one ArbiterPolicy (shared/planner/arbiter.py); after each
step its purchases (PlanPurchased, with the plan ids the core gave the bought effects) are published on
`tidal.v1.evt.plan.purchased` before those effects' PlanDecided, and kept for `tidal.v1.planner.purchases`,
which only the lease holder subscribes to (services/planner/purchases.py).
"""
from __future__ import annotations

import asyncio
import contextvars
import secrets
import time

from shared.actors import Actor
from shared.bus import Delivery, Subscription
from shared.config import ClusterConfig
from shared.events.plan import (
    CapacityReply, CapacityRequest, PlanApplied, PlanCancelled, PlanDecided, PlanFailed, PlanOutcome, PlanPurchased,
    PurchaseLogReply, PurchaseLogRequest,
)
from shared.events.dispatch import DispatchStats
from shared.events.predict import Forecast
from shared.events.registry import Bucket, CatalogChanged, ModelRecord, WorkerRecord
from shared.events.worker import WorkerState, WorkerStats
from shared.logging import get_logger
from shared.planner import ClusterView, Effect, PlannerCore, build_view, effect_kind
from shared.planner.arbiter import ArbiterPolicy
from shared.planner.scale_up import ScaleUpPolicy
from shared.registry_client import RegistryClient
from shared.subjects import (
    CATALOG, dispatch_stats, plan_event, planner_capacity, planner_placement, planner_purchases, worker_stats,
)
from shared.wire import TidalError

from services.planner import metrics
from services.planner.apply import apply_effect
from services.planner.demand import DispatcherDemand
from services.planner.lease import Lease
from services.planner.lifecycle import LifecycleWriter
from services.planner.policies import build_policies
from services.planner.purchases import PurchaseLog

log = get_logger("tidal.planner")

_OUTCOME_KIND = {PlanApplied: "applied", PlanFailed: "failed", PlanCancelled: "cancelled"}


class Planner(Actor):
    def __init__(self, config: ClusterConfig, instance: str) -> None:
        super().__init__("planner")
        self.config = config
        self.instance = instance
        p = config.planner
        token = secrets.token_hex(3)
        # effect ids (and buddy-group ids): unique across planner processes (they end up in workers'
        # idempotency keys); policies in the memory economy's order (services/planner/policies.py)
        self.scale_up = ScaleUpPolicy()  # capacity requests (decides nothing on the interval)
        self.core = PlannerCore(build_policies(config, group_prefix=f"bg{token}", scale_up=self.scale_up,
                                               purchase_prefix=f"p{token}-buy"),
                                enabled=p.enabled, default_ttl_s=p.ctl_timeout + 2 * p.interval, id_prefix=f"p{token}")
        self.arbiter = next((x for x in self.core.policies if isinstance(x, ArbiterPolicy)), None)
        self.purchases = PurchaseLog(instance, p.economy)
        self._purchase_sub: Subscription | None = None  # planner.purchases, bound while holding the lease
        self.stats: dict[str, WorkerStats] = {}
        self.dispatch: dict[str, DispatchStats] = {}  # dispatcher -> its latest (their queues are demand)
        self.dead: set[str] = set()
        self.incarnations: dict[str, str] = {}  # worker -> its process, as the registry's record says
        self.models: dict[str, ModelRecord] = {}
        self.forecasts: dict[str, Forecast] = {}
        self.kinds: dict[str, str] = {}  # effect id -> kind, for the metrics of its outcome
        self.lease: Lease | None = None
        self.lifecycle: LifecycleWriter | None = None  # WarmServe's worker lifecycle ([planner] autoscale)
        self._applying: set[asyncio.Task[None]] = set()

    async def on_start(self) -> None:
        registry = RegistryClient(self.bus)
        self.lease = Lease(registry, name="planner", holder=self.instance, ttl_s=float(self.config.planner.lease_ttl))
        if self.config.planner.autoscale:
            self.lifecycle = LifecycleWriter(registry)
        await self.bind(worker_stats(), WorkerStats, self.on_stats)
        await self.bind(dispatch_stats(), DispatchStats, self.on_dispatch_stats)
        await self.bind(CATALOG["predict.forecast"].wildcard, Forecast, self.on_forecast)
        await self.bind(planner_capacity(), CapacityRequest, self.on_capacity, queue="planner")
        for bucket in (Bucket.WORKERS, Bucket.MODELS):
            self.spawn(f"watch-{bucket}", lambda b=bucket: self._watch(registry, b))
        self.spawn("tick", self._tick_loop)

    async def on_stop(self) -> None:
        for task in list(self._applying):
            task.cancel()  # the workers finish what they were asked; their answers are not awaited
        await asyncio.gather(*self._applying, return_exceptions=True)
        if self.lease is not None:
            await self.lease.release()

    # --- inputs ---------------------------------------------------------------------------
    async def on_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        held = self.stats.get(msg.worker_id)
        if held is not None and msg.ts < held.ts:
            metrics.SKIPPED.labels("stale_stats").inc()  # reordered: keep the newer one
            return
        self.stats[msg.worker_id] = msg

    async def on_dispatch_stats(self, msg: DispatchStats, _ctx: Delivery) -> None:
        held = self.dispatch.get(msg.dispatcher_id)
        if held is None or msg.ts >= held.ts:
            self.dispatch[msg.dispatcher_id] = msg

    def _dispatch_now(self, now: float) -> DispatcherDemand:
        return DispatcherDemand(self.dispatch.values(), now, max_age_s=float(self.config.registry.dead_after))

    async def on_purchase_log(self, msg: PurchaseLogRequest, _ctx: Delivery) -> PurchaseLogReply | None:
        """The latest purchases; only the lease holder answers (it alone is subscribed, and checks)."""
        if self.lease is None or not self.lease.leader:
            return None
        return self.purchases.reply(msg)

    async def _serve_purchase_log(self, leader: bool) -> None:
        """Subscribe to planner.purchases on gaining the lease, unsubscribe on losing it."""
        if leader and self._purchase_sub is None:
            self._purchase_sub = await self.bind(planner_purchases(), PurchaseLogRequest, self.on_purchase_log)
        elif not leader and self._purchase_sub is not None:
            sub, self._purchase_sub = self._purchase_sub, None
            await self.unbind(sub)

    async def on_forecast(self, msg: Forecast, _ctx: Delivery) -> None:
        self.forecasts[msg.model] = msg

    async def on_capacity(self, msg: CapacityRequest, _ctx: Delivery) -> CapacityReply:
        """A dispatcher has requests for `msg.model` and no instance to send them to: scale it up."""
        if not self.config.planner.enabled or self.lease is None or not self.lease.leader:
            return CapacityReply(model=msg.model, outcome="none", retry_after_s=float(self.config.planner.interval))
        view = self.view(time.time())
        self.scale_up.tracker.refresh(view)
        # a start of the model already in flight (this path's, or the autoscaler's, or applied and not yet in
        # the stats): that is the plan; one decision, one LoadModel
        pending = self.scale_up.pending.get(msg.model) or self.scale_up.tracker.plan_of(msg.model)
        if pending is not None:
            return CapacityReply(model=msg.model, outcome="planned", plan_id=pending)
        decision = self.scale_up.for_capacity(view, msg.model)
        effects = self.core.submit(self.scale_up, [decision], view) if decision is not None else []
        if not effects:
            metrics.SKIPPED.labels("no_room").inc()
            log.warning("capacity request: no worker can start the model", model=msg.model,
                        queued=msg.queued_requests, known=msg.model in view.models)
            return CapacityReply(model=msg.model, outcome="none", retry_after_s=float(self.config.planner.interval))
        (effect,) = effects
        self.scale_up.started(effect)
        self.core.dispatched(effect.plan_id)
        kind = self.kinds[effect.plan_id] = effect_kind(effect)
        metrics.EFFECTS.labels(kind, "decided").inc()
        log.info("effect decided", plan_id=effect.plan_id, kind=kind, trigger=effect.trigger, reason=effect.reason)
        await self._publish("decided", PlanDecided(plan=effect))
        task = asyncio.get_running_loop().create_task(self._apply(effect), context=contextvars.Context())
        self._applying.add(task)
        task.add_done_callback(self._applying.discard)
        return CapacityReply(model=msg.model, outcome="planned", plan_id=effect.plan_id)

    async def _watch(self, registry: RegistryClient, bucket: Bucket) -> None:
        async with registry.watch(bucket) as changes:
            async for change in changes:
                async with self.turn():
                    self._on_catalog(change)

    def _on_catalog(self, change: CatalogChanged) -> None:
        record = change.record
        if change.bucket == Bucket.MODELS:
            if isinstance(record, ModelRecord):
                self.models[change.key] = record
            else:
                self.models.pop(change.key, None)
        elif isinstance(record, WorkerRecord) and record.state != WorkerState.DEAD:
            self.dead.discard(change.key)
            self.incarnations[change.key] = record.incarnation
        else:  # dead, or deleted
            self.dead.add(change.key)
        if change.bucket == Bucket.WORKERS and self.lifecycle is not None:
            self.lifecycle.on_record(change.key, record)

    def _worker_liveness(self, worker_id: str) -> str | None:
        """None: the registry says the worker is dead; else its incarnation ("" not known)."""
        return None if worker_id in self.dead else self.incarnations.get(worker_id, "")

    # --- the interval ---------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        interval = float(self.config.planner.interval)
        while True:
            await asyncio.sleep(interval)
            if not self.config.planner.enabled:
                continue  # an external scheduler decides; this planner only runs
            assert self.lease is not None
            leader = await self.lease.tick(time.monotonic())
            metrics.LEADER.set(1 if leader else 0)
            try:
                await self._serve_purchase_log(leader)
            except (TidalError, OSError) as exc:  # NATS away: tried again next interval
                log.warning("planner.purchases subscription not changed", leader=leader, error=repr(exc))
            if not leader:
                async with self.turn():
                    cancelled = self.core.cancel_all(time.time(), "this planner does not hold the lease")
                await self._publish_outcomes(cancelled)
                continue
            await self._tick()

    def view(self, now: float) -> ClusterView:
        p, demand = self.config.planner, self._dispatch_now(now)
        return build_view(
            now, self.stats.values(), dead=self.dead, stats_max_age_s=float(self.config.registry.dead_after),
            interval_s=float(p.interval), models=dict(self.models), forecasts=dict(self.forecasts),
            default_link_budget_bytes=float(p.migration_link_budget),
            default_prefill_budget_tokens=float(p.migration_prefill_budget), queued=demand.queued(),
            adapter_rps=demand.adapter_rps(),
        )

    async def _tick(self) -> None:
        metrics.TICKS.inc()
        async with self.turn():
            view = self.view(time.time())
            effects = self.core.step(view)
            purchases = self.arbiter.take_purchases(effects) if self.arbiter is not None else []
            self.purchases.record(purchases)
            closed: list[PlanOutcome] = list(self.core.take_closed())
            ready = [e for e in effects if self.core.dispatched(e.plan_id) is None]
            hints = self.core.placement_hints(view)  # MELL's state after this step: where new requests go
            lifecycles = self.lifecycle.due(view) if self.lifecycle is not None else {}
        for worker_id, label in lifecycles.items():
            assert self.lifecycle is not None
            task = asyncio.get_running_loop().create_task(self.lifecycle.write(worker_id, label),
                                                          context=contextvars.Context())
            self._applying.add(task)
            task.add_done_callback(self._applying.discard)
        await self._publish_outcomes(closed)
        for hint in hints:
            try:
                await self.bus.publish(planner_placement(), hint)
            except (TidalError, OSError) as exc:  # NATS away: the dispatcher's hints go stale, it routes by load
                log.warning("placement hints not published", model=hint.model, error=repr(exc))
        for purchase in purchases:  # before the PlanDecided of what it bought
            log.info("memory purchased", purchase_id=purchase.purchase_id, scope=purchase.scope,
                     need_bytes=purchase.need_bytes, bought_bytes=purchase.bought_bytes,
                     price_request_s=round(purchase.price_request_s, 4), reason=purchase.reason)
            await self._publish("purchased", purchase)
        await self._launch(effects, ready)

    async def _launch(self, effects: list[Effect], ready: list[Effect]) -> None:
        """Publish new effects as decided, then apply those dispatched, each in a task of its own."""
        for effect in effects:
            self.scale_up.tracker.named(effect)  # a start's plan id (capacity requests are answered with it)
            kind = self.kinds[effect.plan_id] = effect_kind(effect)
            metrics.EFFECTS.labels(kind, "decided").inc()
            log.info("effect decided", plan_id=effect.plan_id, kind=kind, trigger=effect.trigger, reason=effect.reason)
            await self._publish("decided", PlanDecided(plan=effect))
        for effect in ready:
            task = asyncio.get_running_loop().create_task(self._apply(effect), context=contextvars.Context())
            self._applying.add(task)
            task.add_done_callback(self._applying.discard)

    async def _apply(self, effect: Effect) -> None:
        outcome = await apply_effect(self.bus, effect, timeout_s=float(self.config.planner.ctl_timeout),
                                     worker_lost=self._worker_liveness)
        async with self.turn():
            ended = self.core.on_outcome(outcome)
            # the next step of a sequence, at once (KunServe: the drops once every member joined)
            leader = self.lease is not None and self.lease.leader
            more = self.core.follow_up(self.view(time.time())) if ended is not None and leader else []
            ready = [e for e in more if self.core.dispatched(e.plan_id) is None]
        if ended is None:  # it had already ended (expired, or cancelled when the lease was lost)
            metrics.SKIPPED.labels("late_outcome").inc()
            log.info("late outcome skipped", plan_id=effect.plan_id, outcome=type(outcome).__name__)
            return
        await self._publish_outcomes([outcome])
        await self._launch(more, ready)

    async def _publish_outcomes(self, outcomes: list[PlanOutcome]) -> None:
        for outcome in outcomes:
            self.purchases.ended(outcome)  # a bought effect: applied, refused or failed
            label = _OUTCOME_KIND[type(outcome)]
            metrics.EFFECTS.labels(self.kinds.pop(outcome.plan_id, "unknown"), label).inc()
            await self._publish(label, outcome)

    async def _publish(self, kind: str, msg: PlanDecided | PlanOutcome | PlanPurchased) -> None:
        try:
            await self.bus.publish(plan_event(kind), msg)
        except (TidalError, OSError) as exc:  # NATS away: the decision stands, its event is lost
            log.warning("plan event not published", kind=kind, error=repr(exc))


__all__ = ["Planner"]
