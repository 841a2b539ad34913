"""Who buys memory, when: the arbiter (memory_market.buy over every source's offers) and the
mechanisms' own triggers (single arms and the planner's fixed order), all every tick (1 s). It chooses
only: the offers and their prices come from economy_pricing.py, what is bought is carried out by
economy_execution.py.

An instance needs memory when its KV use is at or above the high watermark (0.9) or requests wait
in its engine for memory. Its `Need`, in bytes: the KV its running requests grow into within the
horizon (one token per decode step at its current step time, each capped by the context length),
plus its waiting requests' prompts, minus its free KV; waiting: its waiting requests (at least 1);
preempted: the running requests the growth that does not fit would preempt (at a mean context's KV
each), each recomputing its context (the engine's prefill cost per token); drain: the KV its
finished requests freed per second over the last horizon, or, if more, what its running requests free
as they end (each one's KV over the time to its last token, or over the horizon if it ends within it);
slack: each waiting request's time left to
its TTFT SLO (a wait counts past it); duration: until the drain, net of the KV the model's arrivals bring
the instance meanwhile (`inflow`), frees the bytes (at least the horizon, at most the forecast window).
"""
from __future__ import annotations

from collections import Counter, deque

from loadgen.sim.economy_capacity import decode_left
from loadgen.sim.economy_execution import OfferExecutor
from loadgen.sim.economy_pricing import FleetView, SourcePricer
from loadgen.sim.economy_state import ArmConfig
from loadgen.sim.fleet_state import Instance
from shared.policy.memory_market import SOURCES, Need, Offer, buy, need_duration_s


class EconomyArbiter:
    """The arm's chooser: finds the needs, asks `pricer` for offers, and has `executor` carry out what it buys
    (by price, in the fixed order, or on each mechanism's own trigger)."""

    def __init__(self, fleet: FleetView, pricer: SourcePricer, executor: OfferExecutor, arm: ArmConfig, *,
                 arrival_tokens: dict[str, deque[tuple[float, int]]], counts: Counter[str]) -> None:
        self.fleet, self.pricer, self.executor, self.arm = fleet, pricer, executor, arm
        self.spec = pricer.eprofile.spec
        self.horizon_s, self.hi = self.spec.horizon_s, self.spec.kv_high_watermark
        self.arrival_tokens = arrival_tokens  # each model's arrivals' KV demand, recorded by the simulator
        self.counts = counts

    # --- needs ---------------------------------------------------------------------------
    def need(self, inst: Instance, now: float) -> Need | None:
        w = inst.engine
        if not inst.ready(now) or w.total <= 0:
            return None
        if w.used < self.hi * w.total and not (w.waiting and w.blocked_on == "memory"):
            return None
        m = self.fleet.models[inst.model]
        step = max(w.step_s(), 1e-6)  # type: ignore[attr-defined]
        per_req = self.horizon_s / step
        grow, ctxs, expected = 0, [], 0.0
        for _, _, epoch, r in w.heap:
            if epoch == r.epoch:
                ctx = r.ctx0 + w.step - r.start_step
                left = decode_left(w, r)
                ctxs.append(ctx)
                grow += min(per_req, m.max_model_len - ctx, left)
                # what it frees when it ends, spread over the time until then, or over the horizon if it ends
                # within it (it frees its KV once: a request one step from its end is not a drain of KV / step)
                expected += (ctx + max(0, left)) * m.kv_bytes_per_token / max(max(1, left) * step, self.horizon_s)
        waiting = sum(w._blocks(r.to_prefill) for r in w.waiting) * w.bs
        block = w.pool.block_bytes  # type: ignore[attr-defined]
        free = (w.total - w.used) * block
        grow_bytes = int(max(0.0, grow) * m.kv_bytes_per_token)
        nbytes = grow_bytes + waiting * m.kv_bytes_per_token - free
        if nbytes <= 0:
            return None
        # measured over the last horizon, or what the running requests will free as they end, if more (in a
        # burst of long generations none may have ended in the last horizon: a measured 0 would price waiting
        # as if nothing ever finished)
        drain = max(self.pricer.drain(inst, now), expected)
        # the growth that does not fit preempts running requests (the newest, each holding a mean context's KV)
        # and each is recomputed: a prefill of its context at this engine's per-token prefill cost
        preempted, recompute = 0, 0.0
        if ctxs and grow_bytes > free:
            mean_ctx = sum(ctxs) / len(ctxs)
            preempted = min(len(ctxs), -(-(grow_bytes - free) // max(1, int(mean_ctx * m.kv_bytes_per_token))))
            recompute = mean_ctx * w.cost.prefill_per_token_s
        # the first waiting prompt is indivisible: once the growth fits, a purchase helps only if that prompt
        # fits whole beside it; while the growth does not fit, every byte spares a preemption
        head = w._blocks(w.waiting[0].to_prefill) * w.bs * m.kv_bytes_per_token if w.waiting else 0
        least = 0 if grow_bytes > free else min(nbytes, max(0, int(grow_bytes + head - free)))
        # it lasts until the scope drains the bytes itself: at least the horizon, at most the forecast window
        # net of the KV the model's arrivals bring this instance meanwhile: while it is at or above the drain, the
        # need persists (a start that lands after the running requests' ends still covers it)
        lasts = need_duration_s(nbytes, drain, self.inflow(inst, now), self.horizon_s,
                                max(self.horizon_s, self.fleet.window_s))
        return Need(f"worker:i{inst.id}", nbytes, self.horizon_s, max(1, len(w.waiting)), drain,
                    preempted=preempted, recompute_s=recompute, min_bytes=least,
                    slack_s=self.pricer.slack(w.waiting, now), duration_s=lasts)

    def inflow(self, inst: Instance, now: float) -> float:
        """The KV bytes per second the model's arrivals bring this instance: `arrival_kv` shared evenly among the
        model's accepting instances (the dispatcher's spread)."""
        accepting = sum(1 for i in self.fleet.instances[inst.model] if not i.grace and i.ready(now))
        return self.arrival_kv(inst.model, now) / max(1, accepting)

    def arrival_kv(self, model: str, now: float) -> float:
        """The KV bytes per second the model's arrivals bring: its arrivals over the last horizon, each the KV it
        comes to hold (prompt and output, capped at the context length). Each arrival's output is read from the
        trace, as the drain reads each running request's remaining output (the simulator's oracle on lengths;
        live, the forecast's mean prompt and output stand in)."""
        q = self.arrival_tokens.get(model)
        if not q:
            return 0.0
        while q and q[0][0] < now - self.horizon_s:
            q.popleft()
        return sum(t for _, t in q) * self.fleet.models[model].kv_bytes_per_token / self.horizon_s

    def model_need(self, model: str, now: float) -> Need | None:
        """Requests queued at the fleet with no instance of their model to go to (none has room, or none is
        left; the live arbiter's `model:<name>` need): the KV they come to hold, the first one's prompt whole at
        least; drained by the model's instances as they free KV (measured; 0 with none), lasting while its
        arrivals bring more."""
        fleet = self.fleet
        q = fleet.queues[model]
        if not q or fleet._room(model) is not None:
            return None
        m = fleet.models[model]
        per_token = m.kv_bytes_per_token
        nbytes = int(sum(min(r.prompt + r.output, m.max_model_len) for r in q) * per_token)
        least = min(nbytes, int(q[0].to_prefill * per_token))
        drain = sum(self.pricer.drain(i, now) for i in fleet.instances[model])
        lasts = need_duration_s(nbytes, drain, self.arrival_kv(model, now), self.horizon_s,
                                max(self.horizon_s, fleet.window_s))
        return Need(f"model:{model}", nbytes, self.horizon_s, len(q), drain, min_bytes=least,
                    slack_s=self.pricer.slack(q, now), duration_s=lasts)

    def offers(self, inst: Instance, now: float, need: Need) -> list[Offer]:
        a, p, out = self.arm, self.pricer, []
        if a.prewarm_evict:
            out += p.prewarm_offers(inst, now)
        if a.adapter_evict:
            out += p.adapter_offers(inst, now)
        if a.layer_drop:
            out += p.layer_offers(inst, now)
        if a.migrate:
            out += p.migrate_offers(inst, now)
        if a.scale_out:
            out += p.scale_out_offers(inst, now) + self.executor.reclaim.offers(inst, now, need.lasts_s)
        return out

    # --- choosing ------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        self.executor.reclaim.settle(now)
        if self.arm.layer_drop:
            self.executor.restore_groups(now)
        mode = self.arm.mode
        instances = self.fleet.instances
        for model in self.fleet.models:
            for inst in list(instances[model]):
                if inst not in instances[model]:
                    continue
                if mode == "arbiter":
                    self.arbitrate(inst, now)
                elif mode == "fixed":
                    self.fixed_order(inst, now)
                elif mode == "fixed-needs":
                    self.needs_fixed_order(inst, now)
                elif mode == "single":
                    self.own_triggers(inst, now)
        if mode == "arbiter" and self.arm.scale_out:
            for model in self.fleet.models:
                need = self.model_need(model, now)
                if need is not None:
                    self.buy(need, self.executor.reclaim.model_offers(model, now, need.lasts_s), now)

    def arbitrate(self, inst: Instance, now: float) -> None:
        need = self.need(inst, now)
        if need is not None:
            self.buy(need, self.offers(inst, now, need), now)

    def buy(self, need: Need, offers: list[Offer], now: float) -> None:
        purchase = buy(need, offers)
        self.counts["needs"] += 1
        bought = {id(o) for o in purchase.bought}
        rest = [o for o in purchase.offers if id(o) not in bought]
        unbought = f"{rest[0].source} {rest[0].target} {rest[0].price:.3g}" if rest else ""
        if not purchase.bought:
            self.counts["needs_waited"] += 1
        for o in purchase.bought:
            self.executor.execute(o, now, unbought)

    def needs_fixed_order(self, inst: Instance, now: float) -> None:
        """The ablation "needs in fixed order": the arbiter's needs, covered from the sources in SOURCES' order
        (prices ignored): what the market's pricing adds over its need detection."""
        need = self.need(inst, now)
        if need is None:
            return
        self.counts["needs"] += 1
        offers = sorted(self.offers(inst, now, need), key=lambda o: SOURCES.index(o.source))
        self.fill(offers, need.bytes, now)

    def fill(self, offers: list[Offer], nbytes: int, now: float) -> int:
        """Execute offers in the given order until `nbytes` are covered; the bytes got."""
        got = 0
        for o in offers:
            if got >= nbytes:
                break
            if self.executor.execute(o, now):
                got += o.bytes
        return got

    def fixed_order(self, inst: Instance, now: float) -> None:
        """The planner's order, over the sources this arm has (a source switched off is never used): the
        pool gives lent replicas, then LRU adapters, to KV when it runs short; then layer drop at 95%;
        then migration at the high watermark; then a start."""
        self.relieve(inst, now)
        w = inst.engine
        if self.arm.scale_out and w.waiting and w.blocked_on == "memory":
            self.fill(self.pricer.scale_out_offers(inst, now), 1, now)

    def own_triggers(self, inst: Instance, now: float) -> None:
        """Each mechanism alone, on its own trigger: WarmServe gives a lent replica's KV back and
        CaraServe evicts LRU adapters when the instance needs KV; KunServe and MELL on their thresholds."""
        self.relieve(inst, now)

    def relieve(self, inst: Instance, now: float) -> None:
        """Lent replicas' KV, then LRU adapters, when the instance needs KV; then layer drop; then migration
        (each only where the arm has it)."""
        a = self.arm
        if a.prewarm_evict or a.adapter_evict:
            need = self.need(inst, now)
            if need is not None:
                got = self.fill(self.pricer.prewarm_offers(inst, now), need.bytes, now) if a.prewarm_evict else 0
                if a.adapter_evict:
                    self.fill(self.pricer.adapter_offers(inst, now), need.bytes - got, now)
        if a.layer_drop:
            self.trigger_layers(inst, now)
        if a.migrate:
            self.trigger_migration(inst, now)

    def trigger_layers(self, inst: Instance, now: float) -> None:
        """KunServe: KV use >= 95% -> drop with the buddy using the least of its KV."""
        w = inst.engine
        if w.total and w.used >= self.spec.layer_drop_at * w.total:
            offers = self.pricer.layer_offers(inst, now)
            offers.sort(key=lambda o: o.payload[2].engine.used / max(1, o.payload[2].engine.total))  # type: ignore
            self.fill(offers[:1], 1, now)

    def trigger_migration(self, inst: Instance, now: float) -> None:
        """Llumnix/MELL: KV use >= the high watermark -> move the largest-KV request out."""
        w = inst.engine
        if w.total and w.used >= self.hi * w.total:
            self.fill(self.pricer.migrate_offers(inst, now), 1, now)


__all__ = ["EconomyArbiter"]
