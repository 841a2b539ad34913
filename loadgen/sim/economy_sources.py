"""How each source frees memory in the economy simulator, and what it costs: one code path per
action, used by every arm that may take it, each priced with shared.policy.memory_market's functions.

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
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadgen.sim.economy_result import PurchaseRecord
from loadgen.sim.economy_state import EconomyWorker, scaled
from loadgen.sim.fleet_scaling import _cold_group, scale_up
from loadgen.sim.fleet_state import Instance, Replica
from loadgen.sim.pipeline import put_decoding, set_cost, settle, take_one
from loadgen.sim.request import SimRequest
from shared.policy.forecast_outlook import chance_above
from shared.policy.movement import Precopy
from shared.policy.memory_market import (
    NO_FORECAST_CHANCE, Offer, drop_duration_s, drop_slowdown, price_adapter_eviction, price_layer_drop, price_migration, price_prewarm_eviction, price_scale_out,
)

if TYPE_CHECKING:
    from loadgen.sim.economy import EconomySim

MOVE, RESTORED = 6, 7


@dataclass(eq=False)
class Move:
    """A live migration in flight from one source instance (Llumnix: one per source)."""

    req: SimRequest
    dst: Instance
    plan: Precopy
    epoch: int  # the request's epoch when it began: a preemption since makes it stale
    held: int = 0  # blocks held on the source during the stall
    got: tuple[int, int] = (0, 0)  # (context, generated) taken off the source at the hand-over


class SourcesMixin:
    # --- rates the prices read -------------------------------------------------------------
    def _rate(self: EconomySim, key: str, now: float) -> float:
        """Arrivals per second of a model or an adapter over the last horizon."""
        q = self.arrivals.get(key)
        if not q:
            return 0.0
        while q and q[0] < now - self.horizon_s:
            q.popleft()
        return len(q) / self.horizon_s

    def _rate_over(self: EconomySim, model: str, now: float, span_s: float) -> float:
        """Arrivals per second of a model over the last `span_s` (up to now): the rate to charge over a span that
        long ahead. Read over the 10 s horizon instead, a lull of one horizon priced a capacity taken for a 300 s
        need as if the model would get no request in all of it (issue 32: the 13B's rate read 5.7 -> 0.0 in 6 s at
        the popularity shift's start, 25 req/s seed 3, and its instance was taken then)."""
        ts = self.arrived.get(model)
        span = min(span_s, now)
        if not ts or span <= 0:
            return self._rate(model, now)
        return (len(ts) - bisect_left(ts, now - span)) / span

    def _drain(self: EconomySim, inst: Instance, now: float) -> float:
        """Bytes per second the instance's finished requests freed over the last horizon (measured)."""
        q = self.freed[inst.id]
        while q and q[0][0] < now - self.horizon_s:
            q.popleft()
        return sum(b for _, b in q) / self.horizon_s

    def _chance_needed(self: EconomySim, model: str, fewer: int = 0) -> float:
        """The forecast's chance the model needs more instances than it has (`fewer` less: after one is taken)
        (WarmServe's load: requests in the system; the 0.9 quantile read from the window's peak forecast, an
        assumption); NO_FORECAST_CHANCE without a forecast, as live."""
        series = self.forecasts.get(model)
        if not series:
            return NO_FORECAST_CHANCE
        f = series[min(self.window, len(series) - 1)]
        p = self.system.scaler
        level = p.scale_up_at * p.batch_size * max(0, sum(1 for i in self.instances[model] if not i.grace) - fewer)
        return chance_above(f.avg, max(f.avg, f.peak), level)

    # --- offers (priced) ---------------------------------------------------------------------
    def _prewarm_offers(self: EconomySim, inst: Instance, now: float) -> list[Offer]:
        if not inst.kv_lent_blocks:
            return []
        return [Offer("prewarm", f"i{inst.id}/{r.model}", r.bytes_per_gpu * len(inst.gpus), self._eviction_price(r, now),
                      ("prewarm", inst, r)) for r in {r for g in inst.gpus for r in self.gpus[g].replicas}]

    def _eviction_price(self: EconomySim, r: Replica, now: float) -> float:
        """Evicting a prewarmed replica, whichever source evicts it (a release, a start on its GPUs)."""
        m = self.models[r.model]
        return price_prewarm_eviction(self._chance_needed(r.model), self._rate(r.model, now),
                                      self.profile.cold_start_s(m, self.system.engine_pool),
                                      self.profile.hit_start_s(self.system.engine_pool, m))

    def _adapter_offers(self: EconomySim, inst: Instance, now: float) -> list[Offer]:
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        busy = w.running_adapters()
        m = self.models[inst.model]
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
            rps = self._rate(name, now)
            price = price_adapter_eviction(rps, self.horizon_s, cold, stalled)
            # its bytes are free until its next use (Poisson: 1 / its rate on average), when it is loaded again
            out.append(Offer("adapter", f"i{inst.id}/{name}", w.pool.adapters[name], price, ("adapter", inst, name),
                             lasts_s=1.0 / rps if rps > 0 else math.inf))
        return out

    def _layer_offers(self: EconomySim, inst: Instance, now: float) -> list[Offer]:
        if inst.id in self.group_of or inst.grace:
            return []
        eff = self.eprofile.pipeline.efficiency(2)
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        nbytes = w.pool.weights // 2
        restore = self.moves.layer_restore_s(nbytes // len(inst.gpus))  # each GPU over its own host link
        # it lasts until this instance's KV is below the restore level of its restored KV (bytes x duration), at
        # the net drain: freed by finishing requests less one token per step for each decoding one
        level = self.eprofile.spec.restore_below * w.pool.kv_blocks(0)
        growth = w.decoding * self.models[inst.model].kv_bytes_per_token / max(w.step_s(), 1e-6)
        duration = drop_duration_s(max(0.0, w.used - level) * w.pool.block_bytes, self._drain(inst, now) - growth,
                                   self.horizon_s, max(self.horizon_s, self.window_s))
        out = []
        for b in self.instances[inst.model]:
            if b is inst or b.id in self.group_of or b.grace or not b.ready(now):
                continue
            running = w.running() + b.engine.running()  # type: ignore[attr-defined]
            price = price_layer_drop(drop_slowdown(eff), running, duration, restore)
            out.append(Offer("layers", f"i{inst.id}+i{b.id}", nbytes, price, ("layers", inst, b)))
        return out

    def _migrate_offers(self: EconomySim, inst: Instance, now: float) -> list[Offer]:
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
        for d in self.instances[inst.model]:
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

    def _scale_out_offers(self: EconomySim, inst: Instance, now: float) -> list[Offer]:
        w = inst.engine
        if not w.waiting or not any(g.instance is None for g in self.gpus):
            return []
        m = self.models[inst.model]
        free = {g.index for g in self.gpus if g.instance is None}
        hit = next((r for r in self.replicas if r.model == inst.model and set(r.gpus) <= free and r.loaded(now)), None)
        start = self.profile.hit_start_s(self.system.engine_pool, m) if hit else \
            self.profile.cold_start_s(m, self.system.engine_pool)
        # the GPUs it takes whole (scale_up's choice): other models' replicas there are evicted, at their price
        gpus = hit.gpus if hit is not None else (_cold_group(self, m.parallel, free) or ())
        if not gpus:
            return []  # no group of free GPUs: a start is possible only on capacity taken (economy_capacity.py)
        evicted = {r for g in gpus for r in self.gpus[g].replicas if r.model != inst.model}
        eviction = sum(self._eviction_price(r, now) for r in evicted)
        nbytes = self.profile.kv_blocks(m) * self.eprofile.block_bytes(m)
        price = price_scale_out(start, len(w.waiting), eviction, self._slack(w.waiting, now))
        # its bytes exist only once it lands
        return [Offer("scale_out", f"{inst.model}<-i{inst.id}", nbytes, price, ("scale_out", inst, None), after_s=start)]

    # --- executing a bought offer (every arm's one path per action) -------------------------
    def _execute(self: EconomySim, offer: Offer, now: float, unbought: str = "") -> bool:
        kind, inst, arg = offer.payload  # type: ignore[misc]
        done = {"prewarm": self._release_replica, "adapter": self._evict_adapter, "layers": self._drop_layers,
                "migrate": self._migrate, "scale_out": self._scale_out,
                "reclaim": lambda i, v, t: self.reclaim.take(self, i, v, t)}[kind](inst, arg, now)
        # outcomes, as live (issue 32 item 4): bought, applied at once, or refused (the state moved since the
        # offer); a migration applied here can still fail in flight (counted as failed_migrations)
        self.counts["bought"] += 1
        self.counts["applied" if done else "refused"] += 1
        if done:
            scope = f"model:{inst}" if isinstance(inst, str) else f"gpu:{inst.gpus[0]}"  # a model's queued requests
            self.purchases.append(PurchaseRecord(now, scope, offer.source, offer.target, offer.bytes, offer.price,
                                                 unbought))
        return done

    def _release_replica(self: EconomySim, inst: Instance, r: Replica, now: float) -> bool:
        if r not in self.replicas:
            return False
        self.evict(r)
        self.counts["prewarm_released"] += 1
        return True

    def _evict_adapter(self: EconomySim, inst: Instance, name: str, now: float) -> bool:
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        if name not in w.adapters or name in w.running_adapters():
            return False
        del w.adapters[name]
        del w.pool.adapters[name]
        self.counts["adapter_evictions"] += 1
        self._kick(inst, now)
        return True

    def _drop_layers(self: EconomySim, a: Instance, b: Instance, now: float) -> bool:
        if a.id in self.group_of or b.id in self.group_of or a not in self.instances[a.model] or \
                b not in self.instances[b.model]:
            return False
        factor = 1.0 + drop_slowdown(self.eprofile.pipeline.efficiency(2))  # what the price charges
        for x, y in ((a, b), (b, a)):
            w: EconomyWorker = x.engine  # type: ignore[assignment]
            settle(w, now)
            self._collect(x, now)
            w.pool.dropped = w.pool.weights // 2
            set_cost(w, scaled(self.base_cost[x.id], factor))
            self.group_of[x.id] = y
        self.counts["groups"] += 1
        self._kick(a, now)
        self._kick(b, now)
        return True

    def _restore_groups(self: EconomySim, now: float) -> None:
        """Restore a group once each live member's KV fits below `restore_below` of its restored KV."""
        for iid, partner in list(self.group_of.items()):
            if iid not in self.group_of or iid in self.restoring:
                continue
            members = [i for i in (self.by_id.get(iid), partner) if i is not None and i in self.instances[i.model]]
            if any(m.engine.used > self.eprofile.spec.restore_below * m.engine.pool.kv_blocks(0)  # type: ignore
                   for m in members):
                continue
            for m in members:
                w = m.engine
                settle(w, now)
                self._collect(m, now)
                nbytes, w.pool.dropped = w.pool.dropped, 0  # type: ignore[attr-defined]
                self._kick(m, now)
            self.restoring.update((iid, partner.id))
            restore = self.moves.layer_restore_s(nbytes // len(partner.gpus))
            self._at(now + restore, RESTORED, (iid, partner.id))

    def _restored(self: EconomySim, ids: tuple[int, int], now: float) -> None:
        for iid in ids:
            self.group_of.pop(iid, None)
            self.restoring.discard(iid)
            inst = self.by_id.get(iid)
            if inst is not None and inst in self.instances[inst.model]:
                settle(inst.engine, now)
                self._collect(inst, now)
                set_cost(inst.engine, self.base_cost[iid])
                self._kick(inst, now)
        self.counts["restores"] += 1

    def _migrate(self: EconomySim, src: Instance, arg, now: float) -> bool:
        req, dst, plan = arg
        d = dst.engine
        if src.id in self.moving or dst not in self.instances[dst.model] or req.finish >= 0 or \
                d.total - d.used < plan.blocks:
            return False
        settle(d, now)
        self._collect(dst, now)
        d.used += plan.blocks  # the destination holds them for the whole copy
        dst.outstanding += 1  # it is the request's destination from now (no release meanwhile)
        self._kick(dst, now)
        self.moving[src.id] = Move(req, dst, plan, req.epoch)
        self._at(now + plan.precopy_s, MOVE, ("handover" if plan.ok else "release", src))
        return True

    def _move_event(self: EconomySim, kind: str, src: Instance, now: float) -> None:
        mv = self.moving[src.id]
        w, d = src.engine, mv.dst.engine
        if kind == "handover":
            got = None
            if mv.req.epoch == mv.epoch:
                settle(w, now)
                self._collect(src, now)
                got = take_one(w, mv.req)
            if got is not None:
                mv.held, mv.got = -(-got[0] // w.bs), got
                w.used += mv.held  # its blocks stay on the source until the copy lands
                self.migration_stall_s += mv.plan.stall_s
                self._kick(src, now)
                self._at(now + mv.plan.stall_s, MOVE, ("landed", src))
                return
            self._kick(src, now)  # finished or preempted meanwhile (Llumnix: ABORTED_SRC)
            kind = "release"
        del self.moving[src.id]
        settle(d, now)
        self._collect(mv.dst, now)
        d.used -= mv.plan.blocks
        if kind == "landed":
            settle(w, now)
            self._collect(src, now)
            w.used -= mv.held
            src.outstanding -= 1
            put_decoding(d, mv.req, *mv.got)
            self.served_by[mv.req.order] = mv.dst.id
            self.counts["migrations"] += 1
            self._kick(src, now)
        else:
            mv.dst.outstanding -= 1
            self.counts["failed_migrations"] += 1
        self._kick(mv.dst, now)
        for inst in (src, mv.dst):
            if inst.grace and inst.outstanding == 0 and inst in self.instances[inst.model]:
                self._release(inst, now)

    def _scale_out(self: EconomySim, inst: Instance, _arg, now: float) -> bool:
        w = inst.engine
        if not w.waiting:
            return False
        new = scale_up(self, inst.model, now)
        if new is None:
            return False
        self.bought_starts.add(new.id)
        moved = deque()
        while w.waiting and len(moved) < new.cap:
            moved.append(w.waiting.pop())  # the latest arrivals go: FCFS keeps the earliest here
        for req in reversed(moved):
            w.queued_tokens -= req.to_prefill
            inst.outstanding -= 1
            self._send(new, req, now)
        self.counts["scale_out_moved"] += len(moved)
        return True


    def _start_queued(self: EconomySim, model: str, now: float) -> bool:
        """A start for requests queued at the fleet with no instance to go to (capacity bought for them)."""
        if not self.queues[model] or self._room(model) is not None:
            return False
        new = scale_up(self, model, now)
        if new is None:
            return False
        self.bought_starts.add(new.id)
        self._pump(model, now)
        return True


def lent_blocks(sim: EconomySim, inst: Instance) -> int:
    """KV blocks an instance lends its GPUs' replicas (the largest share on one GPU, x tp)."""
    held = max(sim.gpus[g].held_bytes() for g in inst.gpus)
    return math.ceil(held * len(inst.gpus) / inst.engine.pool.block_bytes) if held else 0  # type: ignore[attr-defined]


__all__ = ["MOVE", "Move", "RESTORED", "SourcesMixin", "lent_blocks"]
