"""How each source frees memory in the economy simulator, and what it costs: one offer per action, made for
every arm that may take it, each priced with shared.policy.memory_market's functions (carried out by
economy_execution.py).

- prewarm: evict a replica lent into an instance's KV (the KV comes back at once); price: the
  forecast's chance the replica's model needs a start within the horizon, times the cold start's
  extra over a hit (price_prewarm_eviction);
- adapter: evict a resident adapter no running request uses; price: its chance of reuse within the
  horizon (recent arrival rate) times its next cold use (CPU-assisted extra with CaraServe's path,
  else the inline load x the batch it stalls);
- layers: drop half the layers of the instance and of a buddy (same model, not grouped): both gain
  those bytes as KV at once and run at step time / efficiency(2) until restored (restore: the dropped
  bytes back over the host link, once both fit in their restored KV below `restore_below`);
- migrate: Llumnix's live migration of the largest-KV decoding request to the same model's instance
  with the most room (MovementCosts.kv_precopy: the destination reserves the blocks, the request
  stalls for the last stage); price: that stall;
- scale_out: start an instance (the autoscaler's scale_up: prewarm hit, host or storage) and move the
  instance's waiting requests to it; price: the start time x those requests, plus the eviction price of
  every other model's replica on the GPUs it takes (the same price as releasing it).

`SourcePricer` reads the simulator's state and changes none of it (it only forgets arrivals and freed
bytes older than the horizon, and caches each model's unloaded step cost).
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from typing import Protocol

from loadgen.sim.economy_profile import EconomyProfile
from loadgen.sim.economy_state import ArmConfig, EconomyWorker
from loadgen.sim.fleet_profile import FleetModel, FleetProfile
from loadgen.sim.fleet_scaling import _cold_group
from loadgen.sim.fleet_state import FleetSystem, GpuState, Instance, Replica
from loadgen.sim.request import SimRequest
from shared.policy.forecast_outlook import chance_above
from shared.policy.memory_market import (
    NO_FORECAST_CHANCE, Offer, drop_duration_s, drop_slowdown, price_adapter_eviction, price_layer_drop,
    price_migration, price_prewarm_eviction, price_scale_out,
)
from shared.policy.movement import MovementCosts
from shared.policy.warmserve_predictor import LoadForecast


class FleetView(Protocol):
    """What the economy's pricing and choosing read of the fleet simulator, live (the forecast window
    advances, GPUs change hands, instances start and end)."""

    profile: FleetProfile
    system: FleetSystem
    models: dict[str, FleetModel]
    gpus: list[GpuState]
    instances: dict[str, list[Instance]]
    queues: dict[str, deque[SimRequest]]
    replicas: list[Replica]
    forecasts: dict[str, list[LoadForecast]]
    window: int
    window_s: float

    def _room(self, model: str) -> Instance | None: ...


class SourcePricer:
    """The sources' offers and their prices: what each would free, and what it would cost."""

    def __init__(self, fleet: FleetView, eprofile: EconomyProfile, arm: ArmConfig, moves: MovementCosts, *,
                 ranks: dict[str, int], slo: tuple[float, float], arrivals: dict[str, deque[float]],
                 arrived: dict[str, list[float]], freed: dict[int, deque[tuple[float, int]]],
                 group_of: dict[int, Instance], moving: dict) -> None:
        self.fleet, self.eprofile, self.arm, self.moves = fleet, eprofile, arm, moves
        self.horizon_s, self.hi = eprofile.spec.horizon_s, eprofile.spec.kv_high_watermark
        self.ranks = ranks
        # the TTFT SLO the prices read (max(scale x unloaded TTFT, floor), as the evaluation): a wait counts past it
        self.slo_scale, self.slo_floor_s = slo
        self.slo_costs: dict = {}
        self.arrivals, self.arrived, self.freed = arrivals, arrived, freed  # recorded by the simulator
        self.group_of, self.moving = group_of, moving  # the executor's layer groups and moves in flight

    # --- rates the prices read -------------------------------------------------------------
    def rate(self, key: str, now: float) -> float:
        """Arrivals per second of a model or an adapter over the last horizon."""
        q = self.arrivals.get(key)
        if not q:
            return 0.0
        while q and q[0] < now - self.horizon_s:
            q.popleft()
        return len(q) / self.horizon_s

    def rate_over(self, model: str, now: float, span_s: float) -> float:
        """Arrivals per second of a model over the last `span_s` (up to now): the rate to charge over a span that
        long ahead. Read over the 10 s horizon instead, a lull of one horizon priced a capacity taken for a 300 s
        need as if the model would get no request in all of it (issue 32: the 13B's rate read 5.7 -> 0.0 in 6 s at
        the popularity shift's start, 25 req/s seed 3, and its instance was taken then)."""
        ts = self.arrived.get(model)
        span = min(span_s, now)
        if not ts or span <= 0:
            return self.rate(model, now)
        return (len(ts) - bisect_left(ts, now - span)) / span

    def drain(self, inst: Instance, now: float) -> float:
        """Bytes per second the instance's finished requests freed over the last horizon (measured)."""
        q = self.freed[inst.id]
        while q and q[0][0] < now - self.horizon_s:
            q.popleft()
        return sum(b for _, b in q) / self.horizon_s

    def chance_needed(self, model: str, fewer: int = 0) -> float:
        """The forecast's chance the model needs more instances than it has (`fewer` less: after one is taken)
        (WarmServe's load: requests in the system; the 0.9 quantile read from the window's peak forecast, an
        assumption); NO_FORECAST_CHANCE without a forecast, as live."""
        fleet = self.fleet
        series = fleet.forecasts.get(model)
        if not series:
            return NO_FORECAST_CHANCE
        f = series[min(fleet.window, len(series) - 1)]
        p = fleet.system.scaler
        level = p.scale_up_at * p.batch_size * max(0, sum(1 for i in fleet.instances[model] if not i.grace) - fewer)
        return chance_above(f.avg, max(f.avg, f.peak), level)

    def slack(self, reqs, now: float) -> tuple[float, ...]:
        """Each request's time left to its TTFT SLO (max(scale x its unloaded TTFT, floor), as evaluated)."""
        return tuple(max(self.slo_scale * self.unloaded_ttft(r), self.slo_floor_s) - (now - r.arrival)
                     for r in reqs)

    def unloaded_ttft(self, r) -> float:
        cost = self.slo_costs.get(r.model)
        if cost is None:
            cost = self.slo_costs[r.model] = self.fleet.profile.step_cost(self.fleet.models[r.model])
        return cost.step_s(0, 0, r.prompt)

    # --- offers (priced) ---------------------------------------------------------------------
    def prewarm_offers(self, inst: Instance, now: float) -> list[Offer]:
        if not inst.kv_lent_blocks:
            return []
        gpus = self.fleet.gpus
        return [Offer("prewarm", f"i{inst.id}/{r.model}", r.bytes_per_gpu * len(inst.gpus), self.eviction_price(r, now),
                      ("prewarm", inst, r)) for r in {r for g in inst.gpus for r in gpus[g].replicas}]

    def eviction_price(self, r: Replica, now: float) -> float:
        """Evicting a prewarmed replica, whichever source evicts it (a release, a start on its GPUs)."""
        fleet = self.fleet
        m = fleet.models[r.model]
        return price_prewarm_eviction(self.chance_needed(r.model), self.rate(r.model, now),
                                      fleet.profile.cold_start_s(m, fleet.system.engine_pool),
                                      fleet.profile.hit_start_s(fleet.system.engine_pool, m))

    def adapter_offers(self, inst: Instance, now: float) -> list[Offer]:
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        busy = w.running_adapters()
        m = self.fleet.models[inst.model]
        out = []
        for name in list(w.adapters):  # least recently used first
            if name in busy:
                continue
            rank = self.ranks[name]
            load = self.eprofile.adapter_load_s(rank)
            if self.arm.cpu_assist:
                cold, stalled = self.eprofile.cpu_assist_extra_s(m.prefill_tokens, rank, m.prefill_s, load), 1
            else:
                cold, stalled = load, max(1, w.running())
            rps = self.rate(name, now)
            price = price_adapter_eviction(rps, self.horizon_s, cold, stalled)
            # its bytes are free until its next use (Poisson: 1 / its rate on average), when it is loaded again
            out.append(Offer("adapter", f"i{inst.id}/{name}", w.pool.adapters[name], price, ("adapter", inst, name),
                             lasts_s=1.0 / rps if rps > 0 else math.inf))
        return out

    def layer_offers(self, inst: Instance, now: float) -> list[Offer]:
        if inst.id in self.group_of or inst.grace:
            return []
        eff = self.eprofile.pipeline.efficiency(2)
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        nbytes = w.pool.weights // 2
        restore = self.moves.layer_restore_s(nbytes // len(inst.gpus))  # each GPU over its own host link
        # it lasts until this instance's KV is below the restore level of its restored KV (bytes x duration), at
        # the net drain: freed by finishing requests less one token per step for each decoding one
        level = self.eprofile.spec.restore_below * w.pool.kv_blocks(0)
        growth = w.decoding * self.fleet.models[inst.model].kv_bytes_per_token / max(w.step_s(), 1e-6)
        duration = drop_duration_s(max(0.0, w.used - level) * w.pool.block_bytes, self.drain(inst, now) - growth,
                                   self.horizon_s, max(self.horizon_s, self.fleet.window_s))
        out = []
        for b in self.fleet.instances[inst.model]:
            if b is inst or b.id in self.group_of or b.grace or not b.ready(now):
                continue
            running = w.running() + b.engine.running()  # type: ignore[attr-defined]
            price = price_layer_drop(drop_slowdown(eff), running, duration, restore)
            out.append(Offer("layers", f"i{inst.id}+i{b.id}", nbytes, price, ("layers", inst, b)))
        return out

    def migrate_offers(self, inst: Instance, now: float) -> list[Offer]:
        """Llumnix: the largest-KV decoding request, to the instance with the most free blocks that
        stays below the high watermark with it; one move in flight per source."""
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        if inst.id in self.moving:
            return []
        live = [e[3] for e in w.heap if e[2] == e[3].epoch]
        if not live:
            return []
        req = max(live, key=lambda r: (r.ctx0 + w.step - r.start_step, -r.order))
        ctx = req.ctx0 + w.step - req.start_step
        plan = self.moves.kv_precopy(ctx, w.bs, w.pool.block_bytes, w.step_s())
        best = None
        for d in self.fleet.instances[inst.model]:
            e = d.engine
            if d is inst or d.grace or not d.ready(now) or d.outstanding >= d.cap:
                continue
            if (e.used + plan.blocks) >= self.hi * e.total:
                continue
            if best is None or e.total - e.used > best.engine.total - best.engine.used:
                best = d
        if best is None:
            return []
        # the source's blocks are free once the copy lands (pre-copy, then the last stage), for good
        return [Offer("migrate", req.request_id, -(-ctx // w.bs) * w.pool.block_bytes, price_migration(plan.stall_s),
                      ("migrate", inst, (req, best, plan)), after_s=plan.precopy_s + plan.stall_s)]

    def scale_out_offers(self, inst: Instance, now: float) -> list[Offer]:
        fleet = self.fleet
        w = inst.engine
        if not w.waiting or not any(g.instance is None for g in fleet.gpus):
            return []
        m = fleet.models[inst.model]
        free = {g.index for g in fleet.gpus if g.instance is None}
        hit = next((r for r in fleet.replicas if r.model == inst.model and set(r.gpus) <= free and r.loaded(now)),
                   None)
        start = fleet.profile.hit_start_s(fleet.system.engine_pool, m) if hit else \
            fleet.profile.cold_start_s(m, fleet.system.engine_pool)
        # the GPUs it takes whole (scale_up's choice): other models' replicas there are evicted, at their price
        gpus = hit.gpus if hit is not None else (_cold_group(fleet, m.parallel, free) or ())  # type: ignore[arg-type]
        if not gpus:
            return []  # no group of free GPUs: a start is possible only on capacity taken (economy_capacity.py)
        evicted = {r for g in gpus for r in fleet.gpus[g].replicas if r.model != inst.model}
        eviction = sum(self.eviction_price(r, now) for r in evicted)
        nbytes = fleet.profile.kv_blocks(m) * self.eprofile.block_bytes(m)
        price = price_scale_out(start, len(w.waiting), eviction, self.slack(w.waiting, now))
        # its bytes exist only once it lands
        return [Offer("scale_out", f"{inst.model}<-i{inst.id}", nbytes, price, ("scale_out", inst, None), after_s=start)]


__all__ = ["FleetView", "SourcePricer"]
