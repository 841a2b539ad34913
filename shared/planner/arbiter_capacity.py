"""Capacity on the market, live (issue 32 item 1; pure): for a model whose requests are queued with nowhere
to go, the arbiter offers to scale down an instance of an under-loaded model on a worker where, once that
instance is gone, the needy model's weights fit — as the simulator's `Reclaimer` does
(loadgen/sim/economy_capacity.py).

The offer is a `ScaleDown` of the victim (the source `scale_out`: a new instance's memory) whose bytes are the
KV the needy model's instance would get there, free only once the victim has drained and the start has
landed (`Offer.after_s`: it covers only the part of the need's expected duration after that). Its price is the
one eviction price over the same span, `price_capacity_eviction` of the victim's model (its forecast chance of
needing an instance once it has one fewer, the arrivals the victim would have served, its cold start, and the
need's duration, for which the victim is gone), plus the waiting requests' wait until then (`price_scale_out`). A model is never taken to zero instances. The start
itself is not part of the offer: once the victim's instance is gone, the wrapped autoscaler's `ScaleUp` on
the freed worker is offered to the same need as any start and bought or not at its own price (the victim's
weights, kept prewarmed through the grace period, are then evicted at `prewarm_price`, as any replica).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.events.plan import ScaleDown
from shared.planner.arbiter_offers import Pricing, chance_needed, kv_bytes_per_token, load_s
from shared.planner.effects import Decision
from shared.planner.scale_up import room_bytes
from shared.planner.view import ClusterView, InstanceView, WorkerView
from shared.policy import memory_market as market
from shared.policy.memory_market import Need


@dataclass(frozen=True)
class CapacityOffer:
    decision: Decision
    target: str
    bytes: int  # the KV the needy model's instance would get on the freed worker
    price: float
    after_s: float  # the victim's drain and the start: its bytes exist from then


def drain_s(view: ClusterView, inst: InstanceView, block_tokens: int) -> float:
    """How long the instance takes to finish what it holds: its longest remaining generation (projected KV less
    held, in tokens) at its step time (running / tokens_per_s, the last stats interval's pace); 0 when it holds
    nothing or no pace is measured yet (an instance that generated nothing in the last interval)."""
    if not inst.requests or inst.tokens_per_s <= 0:
        return 0.0
    per_token = kv_bytes_per_token(view, inst, block_tokens)
    if per_token <= 0:
        return 0.0
    tokens_left = max(max(0, r.projected_kv_bytes - r.kv_bytes) for r in inst.requests) / per_token
    return tokens_left * max(1, inst.running) / inst.tokens_per_s


def capacity_offers(view: ClusterView, p: Pricing, need: Need) -> list[CapacityOffer]:
    kind, _, model = need.scope.partition(":")
    record = view.models.get(model)
    if kind != "model" or record is None or record.weight_bytes <= 0:
        return []
    serving: dict[str, list[tuple[WorkerView, InstanceView]]] = {}
    for w in view.usable_workers():
        for i in w.instances:
            if i.accepting:
                serving.setdefault(i.model, []).append((w, i))
    out = []
    for victim_model, insts in sorted(serving.items()):
        if victim_model == model or len(insts) < 2 or victim_model not in view.models:
            continue  # never the needy model itself, never a model's last instance
        vrec = view.models[victim_model]
        fc = view.forecasts.get(victim_model)
        # the victim is gone for the need's expected duration, then a cold start: the arrivals it would have served
        # (its model's forecast rate over its accepting instances) meanwhile, with the chance the model needs it
        evict = market.price_capacity_eviction(chance_needed(view, victim_model, p.settings, fewer=1),
                                               (fc.avg_rps if fc else 0.0) / len(insts),
                                               load_s(p, vrec.weight_bytes), need.lasts_s, p.settings.horizon_s)
        for worker, inst in insts:
            if any(i.model == model for i in worker.instances):
                continue  # the needy model runs there already: its need says that instance is full
            kv = inst.kv_blocks_total * inst.kv_block_bytes
            # once it is gone: the room there now (its unused KV included), the KV it uses, and its weights (kept
            # prewarmed through the grace period, which the start evicts)
            room = room_bytes(worker) + inst.kv_blocks_used * inst.kv_block_bytes + vrec.weight_bytes
            missing = record.weight_bytes - worker.prewarmed.get(model, 0)
            if room < record.weight_bytes:
                continue
            lands = drain_s(view, inst, p.settings.kv_block_tokens) + load_s(p, max(0, missing))
            price = market.price_scale_out(lands, need.waiting, evict, need.slack_s)
            d = Decision(action=ScaleDown(instance_id=inst.instance_id, worker_id=worker.worker_id, model=victim_model),
                         trigger="capacity_request", freed_bytes=kv + vrec.weight_bytes,
                         reason=f"the arbiter scales down {victim_model}'s {inst.instance_id} on {worker.worker_id} "
                                f"for {model}'s queued requests (capacity on the market)")
            out.append(CapacityOffer(d, f"{worker.worker_id}/{model} from {inst.instance_id}/{victim_model}",
                                     room - record.weight_bytes, price, lands))
    return out


__all__ = ["CapacityOffer", "capacity_offers", "drain_s"]
