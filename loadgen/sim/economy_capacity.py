"""Capacity on the market (issue 32, item 1): a start for a memory-blocked instance on GPUs taken from
an under-loaded model — its instance scaled down (it drains: no new requests, released when empty) — when
no free GPUs make a group.

The offer is a `scale_out` (the market's source for a new instance) whose wait is the victim's drain plus
the start, and whose eviction is the victim's: `price_capacity_eviction` with the victim's model's forecast
chance of needing an instance once it has one fewer and its arrivals (the same `price_eviction` a prewarmed
replica's release and a start on a replica's GPUs pay). Only a model that keeps another live instance is
scaled down (none is taken to zero). The need is an instance's (its waiting requests) or, as live, a model's whose
requests are queued at the fleet with no instance to go to (none has room, or the model has none left).

`Reclaimer` is handed the simulator it acts on and keeps only what it adds: the starts waiting for a
victim to drain.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loadgen.sim.fleet_scaling import _cold_group
from loadgen.sim.fleet_state import Instance
from shared.policy.memory_market import Offer, price_capacity_eviction, price_scale_out

if TYPE_CHECKING:
    from loadgen.sim.economy import EconomySim


def drain_s(inst: Instance) -> float:
    """How long the instance takes to finish what it holds: its longest remaining decode at its step time
    (its waiting prompts are admitted first); 0 when it holds nothing."""
    w = inst.engine
    if inst.outstanding == 0:
        return 0.0
    left = [r.output - r.generated for r in (*(e[3] for e in w.heap if e[2] == e[3].epoch), *w.waiting)]
    return max(left, default=0) * max(w.step_s(), 1e-3)  # type: ignore[attr-defined]


@dataclass
class Reclaimer:
    # (victim draining, what it is for: the instance served, or the model whose queued requests are)
    pending: list[tuple[Instance, Instance | str]] = field(default_factory=list)

    def offers(self, sim: EconomySim, inst: Instance, now: float) -> list[Offer]:
        """One offer per victim whose GPUs, with the free ones, make a group for the blocked instance's model."""
        w = inst.engine
        if not w.waiting or any(v is inst for _, v in self.pending):
            return []
        return self._offers(sim, inst.model, list(w.waiting), f"{inst.model}<-i{inst.id}", inst, now)

    def model_offers(self, sim: EconomySim, model: str, now: float) -> list[Offer]:
        """The same for requests queued at the fleet with no instance of their model to go to (none has room,
        or none is left: the live arbiter's `model:<name>` need)."""
        q = sim.queues[model]
        if not q or any(v == model for _, v in self.pending):
            return []
        return self._offers(sim, model, list(q), f"{model}<-queue", model, now)

    def _offers(self, sim: EconomySim, needy: str, waiting: list, target: str, served: Instance | str,
                now: float) -> list[Offer]:
        m = sim.models[needy]
        free = {g.index for g in sim.gpus if g.instance is None}
        if _cold_group(sim, m.parallel, free) is not None:
            return []  # a plain start needs no victim (economy_sources' scale_out offer, the autoscaler's retry)
        start = sim.profile.cold_start_s(m, sim.system.engine_pool)
        slack = sim._slack(waiting, now)
        out = []
        for model, insts in sim.instances.items():
            live = [i for i in insts if not i.grace and i.ready(now)]
            if model == needy or len(live) < 2:
                continue
            for v in live:
                group = _cold_group(sim, m.parallel, free | set(v.gpus))
                if group is None or not set(group) & set(v.gpus):
                    continue
                vm = sim.models[model]
                chance = sim._chance_needed(model, fewer=1)
                evict = price_capacity_eviction(chance, sim._rate(model, now), sim.profile.cold_start_s(
                    vm, sim.system.engine_pool))
                evict += sum(sim._eviction_price(r, now) for g in group for r in sim.gpus[g].replicas
                             if r.model != needy)
                lands = drain_s(v) + start
                price = price_scale_out(lands, len(waiting), evict, slack)
                nbytes = sim.profile.kv_blocks(m) * sim.eprofile.block_bytes(m)
                out.append(Offer("scale_out", f"{target} from i{v.id}/{model}", nbytes, price,
                                 ("reclaim", served, v), after_s=lands))
        return out

    def take(self, sim: EconomySim, inst: Instance | str, victim: Instance, now: float) -> bool:
        """Scale the victim down (it drains), and start the blocked model (an instance's, or the queued requests'
        model) once its GPUs are free."""
        if victim not in sim.instances[victim.model] or victim.grace:
            return False
        sim.counts["capacity_reclaimed"] += 1
        sim._stop(victim, now)
        self.pending.append((victim, inst))
        self.settle(sim, now)
        return True

    def settle(self, sim: EconomySim, now: float) -> None:
        """Start every pending instance whose victim has drained (if its requests still wait)."""
        keep = []
        for victim, inst in self.pending:
            needy = inst if isinstance(inst, str) else inst.model
            landed = {g.instance for g in (sim.gpus[i] for i in victim.gpus) if g.instance is not None
                      and g.instance.model == needy and g.instance is not inst}
            if victim in sim.instances[victim.model]:
                keep.append((victim, inst))
            elif landed:
                # the needy model started there between ticks (the autoscaler's retry on an arrival, once the GPUs
                # were free): the start the capacity was bought for
                sim.bought_starts.update(i.id for i in landed)
                sim.counts["capacity_starts"] += 1
            elif isinstance(inst, str):
                if sim._start_queued(inst, now):
                    sim.counts["capacity_starts"] += 1
            elif inst in sim.instances[inst.model] and sim._scale_out(inst, None, now):
                sim.counts["capacity_starts"] += 1
        self.pending = keep


__all__ = ["Reclaimer", "drain_s"]
