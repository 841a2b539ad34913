"""Capacity on the market (issue 32, item 1): a start for a memory-blocked instance on GPUs taken from
an under-loaded model — its instance scaled down (it drains: no new requests, released when empty) — when
no free GPUs make a group.

The offer is a `scale_out` (the market's source for a new instance) whose bytes exist once the victim has
drained (its running requests' remaining decode, read as the need's drain reads it) and the start has landed
(`Offer.after_s`: it covers only the part of the need's expected duration after that), whose wait is that
drain plus the start, and whose eviction is the victim's over the same span: `price_capacity_eviction` with
the victim's model's forecast chance of needing an instance once it has one fewer, the arrivals the victim
would have served, and the need's duration, for which it is gone (the same `price_eviction` a prewarmed
replica's release and a start on a replica's GPUs pay). Only a model that keeps another live instance is
scaled down (none is taken to zero). The need is an instance's (its waiting requests) or, as live, a model's whose
requests are queued at the fleet with no instance to go to (none has room, or the model has none left).

`Reclaimer` is handed the fleet it acts on, the sources' pricer (economy_pricing.py) and the executor's starts
(economy_execution.py), and keeps only what it adds: the starts waiting for a victim to drain.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

from loadgen.sim.economy_pricing import FleetView, SourcePricer
from loadgen.sim.economy_profile import EconomyProfile
from loadgen.sim.fleet_scaling import _cold_group
from loadgen.sim.fleet_state import Instance
from shared.policy.memory_market import Offer, price_capacity_eviction, price_scale_out


class CapacityFleet(FleetView, Protocol):
    """The fleet a reclaimer reads, and scales a victim down on."""

    def _stop(self, inst: Instance, now: float) -> None: ...


def decode_left(w, r) -> int:
    """Tokens a running request has left to decode: its output less what it had generated when its current run
    began and the steps since (its `generated` is set only when a run begins or ends: read alone it counts a
    request 900 tokens into a 1,000-token output as 1,000 to go). The need's drain reads the same
    (economy_arbiter.EconomyArbiter.need)."""
    return r.output - r.gen_at_start - (w.step - r.start_step)


def drain_s(inst: Instance) -> float:
    """How long the instance takes to finish what it holds: its longest remaining decode at its step time
    (its running requests' tokens left, as the need's drain reads them; its waiting prompts, admitted first, their
    whole output); 0 when it holds nothing."""
    w = inst.engine
    if inst.outstanding == 0:
        return 0.0
    left = [*(decode_left(w, e[3]) for e in w.heap if e[2] == e[3].epoch), *(r.output - r.generated for r in w.waiting)]
    return max(left, default=0) * max(w.step_s(), 1e-3)  # type: ignore[attr-defined]


class Reclaimer:
    """Capacity taken from an under-loaded model: its offers (priced by `pricer`), and the starts it waits to make
    (`scale_out(inst, None, now)` for an instance's waiting requests, `start_queued(model, now)` for a model's)."""

    def __init__(self, fleet: CapacityFleet, pricer: SourcePricer, eprofile: EconomyProfile, *, counts: Counter[str],
                 bought_starts: set[int], scale_out: Callable[[Instance, None, float], bool],
                 start_queued: Callable[[str, float], bool]) -> None:
        self.fleet, self.pricer, self.eprofile = fleet, pricer, eprofile
        self.counts, self.bought_starts = counts, bought_starts
        self.scale_out, self.start_queued = scale_out, start_queued
        # (victim draining, what it is for: the instance served, or the model whose queued requests are)
        self.pending: list[tuple[Instance, Instance | str]] = []

    def offers(self, inst: Instance, now: float, lasts_s: float) -> list[Offer]:
        """One offer per victim whose GPUs, with the free ones, make a group for the blocked instance's model
        (`lasts_s`: the need's expected duration, for which the victim is gone)."""
        w = inst.engine
        if not w.waiting or any(v is inst for _, v in self.pending):
            return []
        return self._offers(inst.model, list(w.waiting), f"{inst.model}<-i{inst.id}", inst, now, lasts_s)

    def model_offers(self, model: str, now: float, lasts_s: float) -> list[Offer]:
        """The same for requests queued at the fleet with no instance of their model to go to (none has room,
        or none is left: the live arbiter's `model:<name>` need)."""
        q = self.fleet.queues[model]
        if not q or any(v == model for _, v in self.pending):
            return []
        return self._offers(model, list(q), f"{model}<-queue", model, now, lasts_s)

    def _offers(self, needy: str, waiting: list, target: str, served: Instance | str,
                now: float, lasts_s: float) -> list[Offer]:
        fleet, pricer = self.fleet, self.pricer
        m = fleet.models[needy]
        free = {g.index for g in fleet.gpus if g.instance is None}
        if _cold_group(fleet, m.parallel, free) is not None:
            return []  # a plain start needs no victim (economy_pricing's scale_out offer, the autoscaler's retry)
        start = fleet.profile.cold_start_s(m, fleet.system.engine_pool)
        slack = pricer.slack(waiting, now)
        out = []
        for model, insts in fleet.instances.items():
            live = [i for i in insts if not i.grace and i.ready(now)]
            if model == needy or len(live) < 2:
                continue
            for v in live:
                group = _cold_group(fleet, m.parallel, free | set(v.gpus))
                if group is None or not set(group) & set(v.gpus):
                    continue
                vm = fleet.models[model]
                chance = pricer.chance_needed(model, fewer=1)
                # the victim is gone for the need's duration, then a cold start: the arrivals it would have served
                # (its model's, read over as long a past as that span, over its live instances) meanwhile, with the
                # chance they need it
                evict = price_capacity_eviction(chance, pricer.rate_over(model, now, lasts_s) / len(live),
                                                fleet.profile.cold_start_s(vm, fleet.system.engine_pool), lasts_s,
                                                pricer.horizon_s)
                evict += sum(pricer.eviction_price(r, now) for g in group for r in fleet.gpus[g].replicas
                             if r.model != needy)
                lands = drain_s(v) + start
                price = price_scale_out(lands, len(waiting), evict, slack)
                nbytes = fleet.profile.kv_blocks(m) * self.eprofile.block_bytes(m)
                out.append(Offer("scale_out", f"{target} from i{v.id}/{model}", nbytes, price,
                                 ("reclaim", served, v), after_s=lands))
        return out

    def take(self, inst: Instance | str, victim: Instance, now: float) -> bool:
        """Scale the victim down (it drains), and start the blocked model (an instance's, or the queued requests'
        model) once its GPUs are free."""
        if victim not in self.fleet.instances[victim.model] or victim.grace:
            return False
        self.counts["capacity_reclaimed"] += 1
        self.fleet._stop(victim, now)
        self.pending.append((victim, inst))
        self.settle(now)
        return True

    def settle(self, now: float) -> None:
        """Start every pending instance whose victim has drained (if its requests still wait)."""
        fleet, keep = self.fleet, []
        for victim, inst in self.pending:
            needy = inst if isinstance(inst, str) else inst.model
            landed = {g.instance for g in (fleet.gpus[i] for i in victim.gpus) if g.instance is not None
                      and g.instance.model == needy and g.instance is not inst}
            if victim in fleet.instances[victim.model]:
                keep.append((victim, inst))
            elif landed:
                # the needy model started there between ticks (the autoscaler's retry on an arrival, once the GPUs
                # were free): the start the capacity was bought for
                self.bought_starts.update(i.id for i in landed)
                self.counts["capacity_starts"] += 1
            elif isinstance(inst, str):
                if self.start_queued(inst, now):
                    self.counts["capacity_starts"] += 1
            elif inst in fleet.instances[inst.model] and self.scale_out(inst, None, now):
                self.counts["capacity_starts"] += 1
        self.pending = keep


__all__ = ["Reclaimer", "drain_s"]
