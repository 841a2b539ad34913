"""Who buys memory, when: the arbiter (memory_market.buy over every source's offers) and the
mechanisms' own triggers (single arms and the planner's fixed order), all every tick (1 s).

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
the instance meanwhile (`_inflow`), frees the bytes (at least the horizon, at most the forecast window).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from loadgen.sim.economy_capacity import decode_left
from loadgen.sim.fleet_state import Instance
from shared.policy.memory_market import SOURCES, Need, Offer, buy, need_duration_s

if TYPE_CHECKING:
    from loadgen.sim.economy import EconomySim


class ArbiterMixin:
    def _need(self: EconomySim, inst: Instance, now: float) -> Need | None:
        w = inst.engine
        if not inst.ready(now) or w.total <= 0:
            return None
        if w.used < self.hi * w.total and not (w.waiting and w.blocked_on == "memory"):
            return None
        m = self.models[inst.model]
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
        drain = max(self._drain(inst, now), expected)
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
        lasts = need_duration_s(nbytes, drain, self._inflow(inst, now), self.horizon_s,
                                max(self.horizon_s, self.window_s))
        return Need(f"worker:i{inst.id}", nbytes, self.horizon_s, max(1, len(w.waiting)), drain,
                    preempted=preempted, recompute_s=recompute, min_bytes=least,
                    slack_s=self._slack(w.waiting, now), duration_s=lasts)

    def _inflow(self: EconomySim, inst: Instance, now: float) -> float:
        """The KV bytes per second the model's arrivals bring this instance: `_arrival_kv` shared evenly among the
        model's accepting instances (the dispatcher's spread)."""
        accepting = sum(1 for i in self.instances[inst.model] if not i.grace and i.ready(now))
        return self._arrival_kv(inst.model, now) / max(1, accepting)

    def _arrival_kv(self: EconomySim, model: str, now: float) -> float:
        """The KV bytes per second the model's arrivals bring: its arrivals over the last horizon, each the KV it
        comes to hold (prompt and output, capped at the context length). Each arrival's output is read from the
        trace, as the drain reads each running request's remaining output (the simulator's oracle on lengths;
        live, the forecast's mean prompt and output stand in)."""
        q = self.arrival_tokens.get(model)
        if not q:
            return 0.0
        while q and q[0][0] < now - self.horizon_s:
            q.popleft()
        return sum(t for _, t in q) * self.models[model].kv_bytes_per_token / self.horizon_s

    def _model_need(self: EconomySim, model: str, now: float) -> Need | None:
        """Requests queued at the fleet with no instance of their model to go to (none has room, or none is
        left; the live arbiter's `model:<name>` need): the KV they come to hold, the first one's prompt whole at
        least; drained by the model's instances as they free KV (measured; 0 with none), lasting while its
        arrivals bring more."""
        q = self.queues[model]
        if not q or self._room(model) is not None:
            return None
        m = self.models[model]
        per_token = m.kv_bytes_per_token
        nbytes = int(sum(min(r.prompt + r.output, m.max_model_len) for r in q) * per_token)
        least = min(nbytes, int(q[0].to_prefill * per_token))
        drain = sum(self._drain(i, now) for i in self.instances[model])
        lasts = need_duration_s(nbytes, drain, self._arrival_kv(model, now), self.horizon_s,
                                max(self.horizon_s, self.window_s))
        return Need(f"model:{model}", nbytes, self.horizon_s, len(q), drain, min_bytes=least,
                    slack_s=self._slack(q, now), duration_s=lasts)

    def _slack(self: EconomySim, reqs, now: float) -> tuple[float, ...]:
        """Each request's time left to its TTFT SLO (max(scale x its unloaded TTFT, floor), as evaluated)."""
        return tuple(max(self.slo_scale * self._unloaded_ttft(r), self.slo_floor_s) - (now - r.arrival)
                     for r in reqs)

    def _unloaded_ttft(self: EconomySim, r) -> float:
        cost = self.slo_costs.get(r.model)
        if cost is None:
            cost = self.slo_costs[r.model] = self.profile.step_cost(self.models[r.model])
        return cost.step_s(0, 0, r.prompt)

    def _offers(self: EconomySim, inst: Instance, now: float, need: Need) -> list[Offer]:
        a, out = self.arm, []
        if a.prewarm_evict:
            out += self._prewarm_offers(inst, now)
        if a.adapter_evict:
            out += self._adapter_offers(inst, now)
        if a.layer_drop:
            out += self._layer_offers(inst, now)
        if a.migrate:
            out += self._migrate_offers(inst, now)
        if a.scale_out:
            out += self._scale_out_offers(inst, now) + self.reclaim.offers(self, inst, now, need.lasts_s)
        return out

    def _economy_tick(self: EconomySim, now: float) -> None:
        self.reclaim.settle(self, now)
        if self.arm.layer_drop:
            self._restore_groups(now)
        mode = self.arm.mode
        for model in self.models:
            for inst in list(self.instances[model]):
                if inst not in self.instances[model]:
                    continue
                if mode == "arbiter":
                    self._arbitrate(inst, now)
                elif mode == "fixed":
                    self._fixed_order(inst, now)
                elif mode == "fixed-needs":
                    self._needs_fixed_order(inst, now)
                elif mode == "single":
                    self._own_triggers(inst, now)
        if mode == "arbiter" and self.arm.scale_out:
            for model in self.models:
                need = self._model_need(model, now)
                if need is not None:
                    self._buy(need, self.reclaim.model_offers(self, model, now, need.lasts_s), now)

    def _arbitrate(self: EconomySim, inst: Instance, now: float) -> None:
        need = self._need(inst, now)
        if need is not None:
            self._buy(need, self._offers(inst, now, need), now)

    def _buy(self: EconomySim, need: Need, offers: list[Offer], now: float) -> None:
        purchase = buy(need, offers)
        self.counts["needs"] += 1
        bought = {id(o) for o in purchase.bought}
        rest = [o for o in purchase.offers if id(o) not in bought]
        unbought = f"{rest[0].source} {rest[0].target} {rest[0].price:.3g}" if rest else ""
        if not purchase.bought:
            self.counts["needs_waited"] += 1
        for o in purchase.bought:
            self._execute(o, now, unbought)

    def _needs_fixed_order(self: EconomySim, inst: Instance, now: float) -> None:
        """The ablation "needs in fixed order": the arbiter's needs, covered from the sources in SOURCES' order
        (prices ignored): what the market's pricing adds over its need detection."""
        need = self._need(inst, now)
        if need is None:
            return
        self.counts["needs"] += 1
        offers = sorted(self._offers(inst, now, need), key=lambda o: SOURCES.index(o.source))
        self._fill(offers, need.bytes, now)

    def _fill(self: EconomySim, offers: list[Offer], nbytes: int, now: float) -> int:
        """Execute offers in the given order until `nbytes` are covered; the bytes got."""
        got = 0
        for o in offers:
            if got >= nbytes:
                break
            if self._execute(o, now):
                got += o.bytes
        return got

    def _fixed_order(self: EconomySim, inst: Instance, now: float) -> None:
        """The planner's order, over the sources this arm has (a source switched off is never used): the
        pool gives lent replicas, then LRU adapters, to KV when it runs short; then layer drop at 95%;
        then migration at the high watermark; then a start."""
        self._relieve(inst, now)
        w = inst.engine
        if self.arm.scale_out and w.waiting and w.blocked_on == "memory":
            self._fill(self._scale_out_offers(inst, now), 1, now)

    def _own_triggers(self: EconomySim, inst: Instance, now: float) -> None:
        """Each mechanism alone, on its own trigger: WarmServe gives a lent replica's KV back and
        CaraServe evicts LRU adapters when the instance needs KV; KunServe and MELL on their thresholds."""
        self._relieve(inst, now)

    def _relieve(self: EconomySim, inst: Instance, now: float) -> None:
        """Lent replicas' KV, then LRU adapters, when the instance needs KV; then layer drop; then migration
        (each only where the arm has it)."""
        a = self.arm
        if a.prewarm_evict or a.adapter_evict:
            need = self._need(inst, now)
            if need is not None:
                got = self._fill(self._prewarm_offers(inst, now), need.bytes, now) if a.prewarm_evict else 0
                if a.adapter_evict:
                    self._fill(self._adapter_offers(inst, now), need.bytes - got, now)
        if a.layer_drop:
            self._trigger_layers(inst, now)
        if a.migrate:
            self._trigger_migration(inst, now)

    def _trigger_layers(self: EconomySim, inst: Instance, now: float) -> None:
        """KunServe: KV use >= 95% -> drop with the buddy using the least of its KV."""
        w = inst.engine
        if w.total and w.used >= self.eprofile.spec.layer_drop_at * w.total:
            offers = self._layer_offers(inst, now)
            offers.sort(key=lambda o: o.payload[2].engine.used / max(1, o.payload[2].engine.total))  # type: ignore
            self._fill(offers[:1], 1, now)

    def _trigger_migration(self: EconomySim, inst: Instance, now: float) -> None:
        """Llumnix/MELL: KV use >= the high watermark -> move the largest-KV request out."""
        w = inst.engine
        if w.total and w.used >= self.hi * w.total:
            self._fill(self._migrate_offers(inst, now), 1, now)


__all__ = ["ArbiterMixin"]
