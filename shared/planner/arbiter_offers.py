"""The memory arbiter's market inputs (pure): the needs a view shows and the price of each offer.

Needs (shared/policy/memory_market.Need, unit request-seconds):
- `worker:<id>` — a usable worker above `kv_high_watermark`, or with requests waiting on its instances:
  the KV its waiting prompts need (queued prompt tokens x KV bytes per token) plus its KV growth over the
  horizon (`kv_growth_blocks_per_s` x block bytes x horizon), less what it has free below the watermark
  (its cached-free prefix blocks are not free here: they are the `prefix` source's offer).
  Its waiting requests wait for it (at least one: a worker past the watermark preempts someone), and it
  drains by itself at its used KV / a request's mean time in the system (Little's law). A need lasts until
  that drain, net of the KV its models' forecast arrivals bring it (`inflow`), frees its bytes.
- `model:<name>` — requests queued at the dispatchers (`view.queued`) while no accepting instance of the
  model has room (every one is on a needy worker, or there is none): their KV (their mean projected KV
  from the model's running requests), or one instance's weights when nothing of the model runs.

Prices: `memory_market.price_*` with inputs from the one movement cost model (`MovementCosts`: loads,
restores, KV pre-copy), the pipeline profile (`PipelineProfile.efficiency`), the prefill cost of the same
cost profile and the forecasts (`forecast_outlook.chance_above` on the concurrency quantiles).
"""
from __future__ import annotations

import math

from collections.abc import Mapping
from dataclasses import dataclass

from shared.events.plan import FormGroup, Migrate, ScaleUp
from shared.planner.scale_up import room_bytes
from shared.planner.view import AdapterView, ClusterView, InstanceView, WorkerView
from shared.policy import memory_market as market
from shared.policy.forecast_outlook import chance_above
from shared.policy.kunserve_profile import PipelineProfile
from shared.policy.memory_market import Need
from shared.policy.movement import MovementCosts, PrefillCost


@dataclass(frozen=True)
class ArbiterSettings:
    horizon_s: float = 10.0  # [planner] horizon: needs and prices look this far ahead
    kv_high_watermark: float = 0.9  # [planner] kv_high_watermark: above it a worker needs memory
    kv_block_tokens: int = 16  # [policies] kv_block_tokens: tokens per KV block
    batch_size: int = 64  # [policies] max_batch_size: requests one instance serves (B)
    request_time_s: float = 2.0  # [planner] request_time: a request's mean time in the system
    # how long a need may last at most (a scope that frees nothing keeps it this long): the forecast window
    # (WarmServe's 5 minutes, the simulator's too); offers' bytes count for the share of it they are free
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if (self.horizon_s <= 0 or self.request_time_s <= 0 or self.kv_block_tokens < 1 or self.batch_size < 1
                or self.window_s < self.horizon_s):
            raise ValueError("arbiter: horizon_s and request_time_s must be > 0, kv_block_tokens and batch_size >= 1, "
                             "window_s >= horizon_s")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError(f"arbiter: kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}")


@dataclass(frozen=True)
class Pricing:
    """The cost models prices come from (the simulator's own: no constant is copied here)."""

    costs: MovementCosts
    prefill: PrefillCost
    pipeline: PipelineProfile
    settings: ArbiterSettings


# --- needs ------------------------------------------------------------------------------------
def layers_held(view: ClusterView, inst: InstanceView) -> int:
    if inst.layers[1] > inst.layers[0]:
        return inst.layers[1] - inst.layers[0]
    record = view.models.get(inst.model)
    return record.num_layers if record is not None else 1


def kv_bytes_per_token(view: ClusterView, inst: InstanceView, block_tokens: int) -> float:
    """A block is one layer's K and V for `block_tokens` tokens (as KunServe's loads count it)."""
    return inst.kv_block_bytes * layers_held(view, inst) / block_tokens


def _drain(instances, s: ArbiterSettings, drains: Mapping[str, float] | None) -> float:
    """The instances' drain: measured (arbiter_drain.DrainMeter) where observed; else, before the second view
    of an instance, its KV over [planner] request_time (the old estimate, only until a measure exists)."""
    return sum(drains[i.instance_id] if drains is not None and i.instance_id in drains
               else i.kv_used_bytes / s.request_time_s for i in instances)


def worker_need(view: ClusterView, worker: WorkerView, s: ArbiterSettings,
                prefill: PrefillCost | None = None, drains: Mapping[str, float] | None = None) -> Need | None:
    """With `prefill`, the running requests its KV growth would preempt are priced too (each waits and then
    re-prefills its context: vLLM's recompute preemption, our engine's too). `drains`: measured drain per
    instance (bytes/s); without, `kv_used / request_time_s`."""
    capacity, live = worker.kv_capacity_bytes, worker.kv_used_bytes
    # cached-free prefix blocks count as free in the engine (it evicts them on demand) but are room only if
    # given up: they are the `prefix` source's to sell (arbiter_prefix.py), so the need counts them as held
    used = live + sum(i.prefix_cached_free_bytes for i in worker.instances)
    waiting = sum(i.waiting for i in worker.instances)
    if not worker.instances or (used <= s.kv_high_watermark * capacity and not waiting):
        return None
    prompts = sum(i.queued_prompt_tokens * kv_bytes_per_token(view, i, s.kv_block_tokens) for i in worker.instances)
    growth = sum(max(0.0, i.kv_growth_blocks_per_s) * i.kv_block_bytes for i in worker.instances) * s.horizon_s
    room = s.kv_high_watermark * capacity - used
    short = int(prompts + growth - room)
    if short <= 0:
        return None
    preempted, recompute = 0, 0.0
    running = worker.requests
    live_room = max(0.0, s.kv_high_watermark * capacity - live)  # the engine evicts cached blocks before preempting
    if prefill is not None and running and growth > live_room:
        mean_kv = max(1.0, sum(r.kv_bytes for r in running) / len(running))
        preempted = min(len(running), math.ceil((growth - live_room) / mean_kv))
        recompute = prefill.reprefill_s(round(sum(r.tokens for r in running) / len(running)))
    drain = live / s.request_time_s if drains is None else _drain(worker.instances, s, drains)
    return Need(f"worker:{worker.worker_id}", short, s.horizon_s, max(1, waiting), drain,
                preempted=preempted, recompute_s=recompute,
                duration_s=_lasts(short, drain, inflow(view, worker.instances, s), s))


def model_need(view: ClusterView, model: str, queued: int, needy: set[str], s: ArbiterSettings,
               drains: Mapping[str, float] | None = None) -> Need | None:
    instances = [(w, i) for w in view.usable_workers() for i in w.instances if i.model == model and i.accepting]
    if queued <= 0 or any(w.worker_id not in needy for w, _ in instances):
        return None  # nothing queued, or an instance has room: the dispatcher places them
    sizes = [r.projected_kv_bytes or r.kv_bytes for _, i in instances for r in i.requests]
    record = view.models.get(model)
    if sizes:
        short = max(1, queued * sum(sizes) // len(sizes))
        least = min(short, max(sizes))  # one request's KV, whole (the largest running: a safe size)
    elif record is not None and record.weight_bytes > 0:
        short = least = record.weight_bytes  # nothing of it runs: an instance's worth, all or nothing
    else:
        return None
    drain = sum(i.kv_used_bytes for _, i in instances) / s.request_time_s if drains is None else \
        _drain([i for _, i in instances], s, drains)
    return Need(f"model:{model}", short, s.horizon_s, queued, drain, min_bytes=least,
                duration_s=_lasts(short, drain, inflow(view, [i for _, i in instances], s), s))


def inflow(view: ClusterView, instances, s: ArbiterSettings) -> float:
    """The KV bytes per second the models' arrivals bring these instances: each instance's share of its model's
    forecast arrival rate (the model's accepting instances share it evenly: the dispatcher's spread) times the KV
    one request comes to hold (the forecast's mean prompt and output tokens); 0 for a model with no forecast (the
    drain alone, as before)."""
    accepting: dict[str, int] = {}
    for w in view.usable_workers():
        for i in w.instances:
            if i.accepting:
                accepting[i.model] = accepting.get(i.model, 0) + 1
    total = 0.0
    for i in instances:
        fc = view.forecasts.get(i.model)
        if fc is None or not i.accepting:
            continue
        tokens = fc.avg_prompt_tokens + fc.avg_output_tokens
        total += fc.avg_rps * tokens * kv_bytes_per_token(view, i, s.kv_block_tokens) / max(1, accepting.get(i.model, 0))
    return total


def _lasts(nbytes: int, drain: float, inflow_bytes_per_s: float, s: ArbiterSettings) -> float:
    """A need lasts until the scope's drain, net of its arrivals' inflow, frees its bytes: at least the horizon,
    at most the window (memory_market.need_duration_s)."""
    return market.need_duration_s(nbytes, drain, inflow_bytes_per_s, s.horizon_s, s.window_s)


def find_needs(view: ClusterView, s: ArbiterSettings, prefill: PrefillCost | None = None,
               drains: Mapping[str, float] | None = None) -> list[Need]:
    """Every need in the view: workers (by id), then models (by name)."""
    needs = [n for w in view.usable_workers() if (n := worker_need(view, w, s, prefill, drains)) is not None]
    needy = {n.scope.split(":", 1)[1] for n in needs}
    for model in sorted(view.queued):
        need = model_need(view, model, view.queued[model], needy, s, drains)
        if need is not None:
            needs.append(need)
    return needs


# --- prices -------------------------------------------------------------------------------------
def load_s(p: Pricing, nbytes: int) -> float:
    """Weights onto a device from the checkpoint (through host memory when the profile models a disk)."""
    return p.costs.load_s(max(0, nbytes), in_host_memory=p.costs.disk is None)


def chance_needed(view: ClusterView, model: str, s: ArbiterSettings, fewer: int = 0) -> float:
    """P(the model needs more instances than it has, `fewer` less: after one is taken) over the forecast's
    concurrency quantiles; `NO_FORECAST_CHANCE` without them (the simulator's default too)."""
    fc = view.forecasts.get(model)
    if fc is None or fc.concurrency_quantiles is None:
        return market.NO_FORECAST_CHANCE
    serving = sum(1 for w in view.usable_workers() for i in w.instances if i.model == model and i.accepting)
    serving = max(0, serving - fewer)
    q = fc.concurrency_quantiles
    return chance_above(q.p50, q.p90, serving * s.batch_size)


def prewarm_price(view: ClusterView, p: Pricing, worker: WorkerView, model: str) -> float:
    warm = worker.prewarmed.get(model, 0)
    weights = view.models[model].weight_bytes if model in view.models else warm
    fc = view.forecasts.get(model)
    return market.price_prewarm_eviction(chance_needed(view, model, p.settings), fc.avg_rps if fc else 0.0,
                                         load_s(p, weights), load_s(p, weights - warm))


def adapter_price(view: ClusterView, p: Pricing, worker: WorkerView, adapter: AdapterView) -> float:
    """Its next use reloads it (from the host copy, or the disk), stalling the batch it joins: an engine
    that loads adapters inline (ours) delays every running request of the step."""
    cold = p.costs.load_s(adapter.bytes, in_host_memory=adapter.host_copy or p.costs.disk is None)
    running = sum(i.running for i in worker.instances)
    return market.price_adapter_eviction(view.adapter_rps.get(adapter.adapter, 0.0), p.settings.horizon_s, cold,
                                         max(1, running))


def migration_price(view: ClusterView, p: Pricing, action: Migrate) -> float | None:
    """The request's stall: the last pre-copy stage (KV) or the destination's re-prefill (tokens); None
    when a KV pre-copy would not converge (not an offer)."""
    where, req = view.location(action.request_id), view.request(action.request_id)
    if where is None or req is None:
        return None
    tokens = max(1, req.kv_tokens or req.tokens)
    if action.mode == "tokens":
        return market.price_migration(p.prefill.reprefill_s(tokens))
    inst = next(i for i in view.workers[where[0]].instances if i.instance_id == where[1])
    block_bytes = max(1, inst.kv_block_bytes * layers_held(view, inst))
    step_s = inst.running / inst.tokens_per_s if inst.tokens_per_s > 0 else 0.0
    precopy = p.costs.kv_precopy(tokens, p.settings.kv_block_tokens, block_bytes, step_s)
    return market.price_migration(precopy.stall_s) if precopy.ok else None


def group_freed(view: ClusterView, action: FormGroup) -> dict[str, int]:
    """Bytes each member's worker gets by dropping every layer it does not keep."""
    record = view.models.get(action.model)
    if record is None:
        return {}
    out: dict[str, int] = {}
    for m in action.members:
        dropped = record.num_layers - (m.layers.end - m.layers.start)
        out[m.worker_id] = out.get(m.worker_id, 0) + max(0, dropped) * record.layer_bytes
    return out


def layer_price(view: ClusterView, p: Pricing, action: FormGroup) -> float | None:
    stages = len(action.members)
    if stages > p.pipeline.max_stages:
        return None
    running = 0
    for m in action.members:
        worker = view.workers.get(m.worker_id)
        inst = next((i for i in worker.instances if i.instance_id == m.instance_id), None) if worker else None
        running += inst.running if inst is not None else 0
    restore = max((p.costs.layer_restore_s(b) for b in group_freed(view, action).values()), default=0.0)
    return market.price_layer_drop(market.drop_slowdown(p.pipeline.efficiency(stages)), running, p.settings.horizon_s, restore)


def scale_out(view: ClusterView, p: Pricing, action: ScaleUp, waiting: int,
              slack_s: tuple[float, ...] = ()) -> tuple[int, float, float] | None:
    """(KV bytes the new instance gets, price, when it lands): its start (less what is warm there) for every
    waiting request, and the price of evicting the warm replica of another model it takes (as
    `prewarm_price`)."""
    worker = view.workers.get(action.worker_id)
    if worker is None or action.model not in view.models:
        return None
    warm = worker.prewarmed.get(action.model, 0)
    missing = max(0, view.models[action.model].weight_bytes - warm)
    # the dearest warm replica of another model the start may evict, priced as any prewarm eviction
    eviction = max((prewarm_price(view, p, worker, m) for m in worker.prewarmed if m != action.model), default=0.0)
    start = load_s(p, missing)
    return max(0, room_bytes(worker) - missing), market.price_scale_out(start, waiting, eviction, slack_s), start


def until_next_use(view: ClusterView, adapter: str) -> float:
    """How long an offloaded adapter's bytes stay free: until its next use, 1 / its arrival rate (Poisson);
    inf when nothing asks for it."""
    rps = view.adapter_rps.get(adapter, 0.0)
    return 1.0 / rps if rps > 0 else math.inf


__all__ = [
    "ArbiterSettings", "Pricing", "adapter_price", "chance_needed", "find_needs", "group_freed", "kv_bytes_per_token",
    "layer_price", "load_s", "migration_price", "model_need", "prewarm_price", "scale_out", "until_next_use",
    "worker_need",
]
