"""Carrying out a bought offer in the economy simulator: every arm's one path per action (the offers and
their prices: economy_pricing.py). The only part of the economy that changes the fleet's state: replicas
released, adapters evicted, layers dropped and restored, requests moved, instances started, capacity
taken (economy_capacity.py's `Reclaimer`); each purchase recorded with its outcome.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Protocol

from loadgen.sim.economy_capacity import Reclaimer
from loadgen.sim.economy_pricing import FleetView, SourcePricer
from loadgen.sim.economy_profile import EconomyProfile
from loadgen.sim.economy_result import PurchaseRecord
from loadgen.sim.economy_state import EconomyWorker, scaled
from loadgen.sim.fleet_scaling import scale_up
from loadgen.sim.fleet_state import FleetControl, GpuState, Instance, Replica
from loadgen.sim.pipeline import put_decoding, set_cost, settle, take_one
from loadgen.sim.request import SimRequest
from shared.policy.memory_market import Offer, drop_slowdown
from shared.policy.movement import MovementCosts, Precopy

MOVE, RESTORED = 6, 7


class FleetActions(FleetView, FleetControl, Protocol):
    """What carrying out a purchase does to the fleet simulator (its own dispatch, start and release paths)."""

    served_by: list[int]

    def _kick(self, inst: Instance, now: float) -> None: ...

    def _collect(self, inst: Instance, now: float) -> None: ...

    def _stop(self, inst: Instance, now: float) -> None: ...

    def _release(self, inst: Instance, now: float) -> None: ...

    def _send(self, inst: Instance, req: SimRequest, now: float) -> None: ...

    def _pump(self, model: str, now: float) -> None: ...


@dataclass(eq=False)
class Move:
    """A live migration in flight from one source instance (Llumnix: one per source)."""

    req: SimRequest
    dst: Instance
    plan: Precopy
    epoch: int  # the request's epoch when it began: a preemption since makes it stale
    held: int = 0  # blocks held on the source during the stall
    got: tuple[int, int] = (0, 0)  # (context, generated) taken off the source at the hand-over


class OfferExecutor:
    """Executes bought offers and what follows from them (restores, moves' events, starts for queued requests).
    `at(t, kind, payload)` schedules one of the simulator's events (MOVE, RESTORED)."""

    def __init__(self, fleet: FleetActions, pricer: SourcePricer, eprofile: EconomyProfile, moves: MovementCosts,
                 at: Callable[[float, int, object], None], *, counts: Counter[str], purchases: list[PurchaseRecord],
                 bought_starts: set[int], by_id: dict[int, Instance], base_cost: dict,
                 group_of: dict[int, Instance], moving: dict[int, Move]) -> None:
        self.fleet, self.eprofile, self.moves, self.at = fleet, eprofile, moves, at
        self.counts, self.purchases, self.bought_starts = counts, purchases, bought_starts
        self.by_id, self.base_cost = by_id, base_cost
        self.group_of, self.moving = group_of, moving  # layer groups (each member -> its partner); moves by source
        self.restoring: set[int] = set()
        self.migration_stall_s = 0.0
        self.reclaim = Reclaimer(fleet, pricer, eprofile, counts=counts, bought_starts=bought_starts,
                                 scale_out=self.scale_out, start_queued=self.start_queued)

    def execute(self, offer: Offer, now: float, unbought: str = "") -> bool:
        kind, inst, arg = offer.payload  # type: ignore[misc]
        done = {"prewarm": self.release_replica, "adapter": self.evict_adapter, "layers": self.drop_layers,
                "migrate": self.migrate, "scale_out": self.scale_out,
                "reclaim": self.reclaim.take}[kind](inst, arg, now)
        # outcomes, as live (issue 32 item 4): bought, applied at once, or refused (the state moved since the
        # offer); a migration applied here can still fail in flight (counted as failed_migrations)
        self.counts["bought"] += 1
        self.counts["applied" if done else "refused"] += 1
        if done:
            scope = f"model:{inst}" if isinstance(inst, str) else f"gpu:{inst.gpus[0]}"  # a model's queued requests
            self.purchases.append(PurchaseRecord(now, scope, offer.source, offer.target, offer.bytes, offer.price,
                                                 unbought))
        return done

    def release_replica(self, inst: Instance, r: Replica, now: float) -> bool:
        if r not in self.fleet.replicas:
            return False
        self.fleet.evict(r)
        self.counts["prewarm_released"] += 1
        return True

    def evict_adapter(self, inst: Instance, name: str, now: float) -> bool:
        w: EconomyWorker = inst.engine  # type: ignore[assignment]
        if name not in w.adapters or name in w.running_adapters():
            return False
        del w.adapters[name]
        del w.pool.adapters[name]
        self.counts["adapter_evictions"] += 1
        self.fleet._kick(inst, now)
        return True

    def drop_layers(self, a: Instance, b: Instance, now: float) -> bool:
        fleet = self.fleet
        if a.id in self.group_of or b.id in self.group_of or a not in fleet.instances[a.model] or \
                b not in fleet.instances[b.model]:
            return False
        factor = 1.0 + drop_slowdown(self.eprofile.pipeline.efficiency(2))  # what the price charges
        for x, y in ((a, b), (b, a)):
            w: EconomyWorker = x.engine  # type: ignore[assignment]
            settle(w, now)
            fleet._collect(x, now)
            w.pool.dropped = w.pool.weights // 2
            set_cost(w, scaled(self.base_cost[x.id], factor))
            self.group_of[x.id] = y
        self.counts["groups"] += 1
        fleet._kick(a, now)
        fleet._kick(b, now)
        return True

    def restore_groups(self, now: float) -> None:
        """Restore a group once each live member's KV fits below `restore_below` of its restored KV."""
        fleet = self.fleet
        for iid, partner in list(self.group_of.items()):
            if iid not in self.group_of or iid in self.restoring:
                continue
            members = [i for i in (self.by_id.get(iid), partner) if i is not None and i in fleet.instances[i.model]]
            if any(m.engine.used > self.eprofile.spec.restore_below * m.engine.pool.kv_blocks(0)  # type: ignore
                   for m in members):
                continue
            for m in members:
                w = m.engine
                settle(w, now)
                fleet._collect(m, now)
                nbytes, w.pool.dropped = w.pool.dropped, 0  # type: ignore[attr-defined]
                fleet._kick(m, now)
            self.restoring.update((iid, partner.id))
            restore = self.moves.layer_restore_s(nbytes // len(partner.gpus))
            self.at(now + restore, RESTORED, (iid, partner.id))

    def restored(self, ids: tuple[int, int], now: float) -> None:
        fleet = self.fleet
        for iid in ids:
            self.group_of.pop(iid, None)
            self.restoring.discard(iid)
            inst = self.by_id.get(iid)
            if inst is not None and inst in fleet.instances[inst.model]:
                settle(inst.engine, now)
                fleet._collect(inst, now)
                set_cost(inst.engine, self.base_cost[iid])
                fleet._kick(inst, now)
        self.counts["restores"] += 1

    def migrate(self, src: Instance, arg, now: float) -> bool:
        fleet = self.fleet
        req, dst, plan = arg
        d = dst.engine
        if src.id in self.moving or dst not in fleet.instances[dst.model] or req.finish >= 0 or \
                d.total - d.used < plan.blocks:
            return False
        settle(d, now)
        fleet._collect(dst, now)
        d.used += plan.blocks  # the destination holds them for the whole copy
        dst.outstanding += 1  # it is the request's destination from now (no release meanwhile)
        fleet._kick(dst, now)
        self.moving[src.id] = Move(req, dst, plan, req.epoch)
        self.at(now + plan.precopy_s, MOVE, ("handover" if plan.ok else "release", src))
        return True

    def move_event(self, kind: str, src: Instance, now: float) -> None:
        fleet = self.fleet
        mv = self.moving[src.id]
        w, d = src.engine, mv.dst.engine
        if kind == "handover":
            got = None
            if mv.req.epoch == mv.epoch:
                settle(w, now)
                fleet._collect(src, now)
                got = take_one(w, mv.req)
            if got is not None:
                mv.held, mv.got = -(-got[0] // w.bs), got
                w.used += mv.held  # its blocks stay on the source until the copy lands
                self.migration_stall_s += mv.plan.stall_s
                fleet._kick(src, now)
                self.at(now + mv.plan.stall_s, MOVE, ("landed", src))
                return
            fleet._kick(src, now)  # finished or preempted meanwhile (Llumnix: ABORTED_SRC)
            kind = "release"
        del self.moving[src.id]
        settle(d, now)
        fleet._collect(mv.dst, now)
        d.used -= mv.plan.blocks
        if kind == "landed":
            settle(w, now)
            fleet._collect(src, now)
            w.used -= mv.held
            src.outstanding -= 1
            put_decoding(d, mv.req, *mv.got)
            fleet.served_by[mv.req.order] = mv.dst.id
            self.counts["migrations"] += 1
            fleet._kick(src, now)
        else:
            mv.dst.outstanding -= 1
            self.counts["failed_migrations"] += 1
        fleet._kick(mv.dst, now)
        for inst in (src, mv.dst):
            if inst.grace and inst.outstanding == 0 and inst in fleet.instances[inst.model]:
                fleet._release(inst, now)

    def scale_out(self, inst: Instance, _arg, now: float) -> bool:
        fleet = self.fleet
        w = inst.engine
        if not w.waiting:
            return False
        new = scale_up(fleet, inst.model, now)
        if new is None:
            return False
        self.bought_starts.add(new.id)
        moved = deque()
        while w.waiting and len(moved) < new.cap:
            moved.append(w.waiting.pop())  # the latest arrivals go: FCFS keeps the earliest here
        for req in reversed(moved):
            w.queued_tokens -= req.to_prefill
            inst.outstanding -= 1
            fleet._send(new, req, now)
        self.counts["scale_out_moved"] += len(moved)
        return True

    def start_queued(self, model: str, now: float) -> bool:
        """A start for requests queued at the fleet with no instance to go to (capacity bought for them)."""
        fleet = self.fleet
        if not fleet.queues[model] or fleet._room(model) is not None:
            return False
        new = scale_up(fleet, model, now)
        if new is None:
            return False
        self.bought_starts.add(new.id)
        fleet._pump(model, now)
        return True


def lent_blocks(gpus: list[GpuState], inst: Instance) -> int:
    """KV blocks an instance lends its GPUs' replicas (the largest share on one GPU, x tp)."""
    held = max(gpus[g].held_bytes() for g in inst.gpus)
    return math.ceil(held * len(inst.gpus) / inst.engine.pool.block_bytes) if held else 0  # type: ignore[attr-defined]


__all__ = ["FleetActions", "MOVE", "Move", "OfferExecutor", "RESTORED", "lent_blocks"]
