"""Capacity on the market (issue 32, item 1): a start for a memory-blocked instance on GPUs taken from
an under-loaded model — its instance scaled down (it drains: no new requests, released when empty) — when
no free GPUs make a group.

The offer is a `scale_out` (the market's source for a new instance) whose wait is the victim's drain plus
the start, and whose eviction is the victim's: `price_capacity_eviction` with the victim's model's forecast
chance of needing an instance once it has one fewer and its arrivals (the same `price_eviction` a prewarmed
replica's release and a start on a replica's GPUs pay). Only a model that keeps another live instance is
scaled down (none is taken to zero).

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
    pending: list[tuple[Instance, Instance]] = field(default_factory=list)  # (victim draining, instance served)

    def offers(self, sim: EconomySim, inst: Instance, now: float) -> list[Offer]:
        """One offer per victim whose GPUs, with the free ones, make a group for the blocked model."""
        w = inst.engine
        if not w.waiting or any(v is inst for _, v in self.pending):
            return []
        m = sim.models[inst.model]
        free = {g.index for g in sim.gpus if g.instance is None}
        if _cold_group(sim, m.parallel, free) is not None:
            return []  # a plain start needs no victim (economy_sources' scale_out offer)
        start = sim.profile.cold_start_s(m, sim.system.engine_pool)
        out = []
        for model, insts in sim.instances.items():
            live = [i for i in insts if not i.grace and i.ready(now)]
            if model == inst.model or len(live) < 2:
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
                             if r.model != inst.model)
                lands = drain_s(v) + start
                price = price_scale_out(lands, len(w.waiting), evict, sim._slack(w.waiting, now))
                nbytes = sim.profile.kv_blocks(m) * sim.eprofile.block_bytes(m)
                out.append(Offer("scale_out", f"{inst.model}<-i{inst.id} from i{v.id}/{model}", nbytes, price,
                                 ("reclaim", inst, v), after_s=lands))
        return out

    def take(self, sim: EconomySim, inst: Instance, victim: Instance, now: float) -> bool:
        """Scale the victim down (it drains), and start the blocked model once its GPUs are free."""
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
            if victim in sim.instances[victim.model]:
                keep.append((victim, inst))
            elif inst in sim.instances[inst.model] and sim._scale_out(inst, None, now):
                sim.counts["capacity_starts"] += 1
        self.pending = keep


__all__ = ["Reclaimer", "drain_s"]
