"""The planner's policies, from the config, in the order of the memory economy (DESIGN §1).

The core asks the policies in list order each interval, and a later policy sees the effects of the
earlier ones as busy, so the order is the order in which memory is bought, cheapest source first:

1. prewarmed weights and cold adapters are not policies here: the worker's pool gives them up for
   KV on demand (reclaimers, adapter LRU), the cheapest memory; KunServe counts a worker's
   prewarmed bytes as KV capacity, so it drops layers only for what evicting them cannot cover;
2. KunServe (`[policies] buddy_groups`): drop replicated layers into buddy groups — instant,
   costs pipeline overhead until restored;
3. MELL (`[policies] migration`): migrate requests to a peer with room — costs link time or a
   re-prefill per request;
4. scale out (ScaleUpPolicy, on capacity requests; WarmServe with `[planner] autoscale`: the public
   code's autoscaler on each model's load, onto prewarmed workers, and prewarms from the forecasts) —
   costs a startup, least when warm. WarmServe goes last: its
   prewarms take only memory no instance uses (idle, universal and grace-period workers, the last
   capped at Eq. 1's target), which the pool gives back first (rung 1), so they never compete with
   the rungs above; and the others' effects on an instance are busy to it.

`[planner] economy = "arbiter"`: the same policies are wrapped in one ArbiterPolicy
(shared/planner/arbiter.py), which prices every offer in request-seconds and buys per need instead of
taking them in this order; it also releases prewarmed replicas and cold adapters itself (rung 1).

Reads the KunServe profile file (`[policies] kunserve_profile`) and, for the arbiter, the cost profile
(`[planner] cost_profile`): a bad path or file fails the planner's start with a message naming it.
"""
from __future__ import annotations

from shared.config import ClusterConfig
from shared.planner.arbiter import ArbiterPolicy
from shared.planner.arbiter_offers import ArbiterSettings, Pricing
from shared.planner.kunserve_policy import KunServePolicy
from shared.planner.mell_policy import MellPolicy
from shared.planner.policy import Policy
from shared.planner.scale_up import ScaleUpPolicy
from shared.planner.warmserve_policy import WarmServePolicy, WarmServeSettings
from shared.policy.saturation import SaturationParams
from shared.profiles import load_pipeline_profile

from services.planner.cost_profile import load_cost_profile


def consolidates(config: ClusterConfig) -> bool:
    """MELL consolidates (packs requests onto fewer workers) when `[planner] consolidate` says so, and under
    "auto" only when the dispatcher places new requests where MELL would (`mell` routing): a load-spreading
    router and a packing planner undo each other's work."""
    setting = config.planner.consolidate
    return setting == "on" or (setting == "auto" and config.dispatcher.routing_policy == "mell")


def build_policies(config: ClusterConfig, *, group_prefix: str, scale_up: ScaleUpPolicy | None = None,
                   purchase_prefix: str = "buy") -> list[Policy]:
    """The interval policies, cheapest source of memory first (or one ArbiterPolicy around them under
    `economy = "arbiter"`). `group_prefix` makes buddy-group ids unique across planner processes, and
    `purchase_prefix` the arbiter's purchase ids; `scale_up` is the capacity-request path (WarmServe counts
    its scale-ups in flight)."""
    p, pol = config.planner, config.policies
    policies: list[Policy] = []
    if pol.buddy_groups:  # false: not constructed, so nothing of KunServe runs
        policies.append(KunServePolicy(load_pipeline_profile(pol.kunserve_profile), kv_block_tokens=pol.kv_block_tokens,
                                       unsplit_max_batch=pol.max_batch_size, group_prefix=group_prefix))
    # MELL's bins must keep decoding within [slo] tpot: a move goes only where it keeps the destination's
    # projected step within it (shared/planner/mell_compute.py)
    policies.append(MellPolicy(migration=pol.migration, kv_high_watermark=p.kv_high_watermark,
                               max_migrations_per_op=p.max_migrations_per_op, packer=p.packer,
                               tpot_s=config.slo.tpot.absolute_s, tpot_factor=config.slo.tpot.factor,
                               consolidate=consolidates(config)))
    if p.autoscale:
        # the public code's autoscaler (shared/policy/autoscaler.py: 0.8 / 0.5 of B per instance over a 5 s
        # window, 5 s protect period), the rule the fleet simulator runs; B = max_batch_size
        # min_instances: the config's, at least 1 when the dispatcher cannot queue for a model with none;
        # saturation: measured queue wait and decode pace against [slo] tpot (shared/policy/saturation.py)
        tpot = config.slo.tpot
        saturation = SaturationParams(tpot_s=tpot.absolute_s, tpot_factor=tpot.factor) if p.scale_on_saturation else None
        policies.append(WarmServePolicy(WarmServeSettings(
            prewarm=pol.prewarm, batch_size=pol.max_batch_size, mean_request_s=float(p.request_time),
            min_instances=p.min_instances if config.dispatcher.scale_from_zero else max(1, p.min_instances),
            keep_alive_s=float(p.keep_alive), saturation=saturation), capacity=scale_up))
    if p.economy == "fixed-order":
        return policies
    profile = load_cost_profile(p.cost_profile)
    settings = ArbiterSettings(horizon_s=float(p.horizon), kv_high_watermark=p.kv_high_watermark,
                               kv_block_tokens=pol.kv_block_tokens, batch_size=pol.max_batch_size,
                               request_time_s=float(p.request_time))
    pricing = Pricing(profile.costs(), profile.step, load_pipeline_profile(pol.kunserve_profile), settings)
    return [ArbiterPolicy(policies, pricing, id_prefix=purchase_prefix)]


__all__ = ["build_policies", "consolidates"]
