"""The memory arbiter (`[planner] economy = "arbiter"`): one market over every mechanism's offers (pure).

`ArbiterPolicy` is a Policy around the mechanism policies (KunServe, MELL, WarmServe). Each interval:
1. finds the needs in the view (arbiter_offers.find_needs: per worker, per model; request-seconds);
2. asks every wrapped policy for its decisions (a later one sees the earlier ones' keys as busy, so no
   key is proposed twice), and classifies each: FormGroup -> "layers", Migrate -> "migrate", ScaleUp ->
   "scale_out", ReleasePrewarm -> "prewarm", ReleaseAdapter -> "adapter", priced with memory_market's
   `price_*`; adds its own offers on each needy worker: release a prewarmed replica, evict a cold adapter,
   release cached-free prefix blocks (arbiter_prefix.py, priced by shared/policy/prefix_price.py);
3. `buy(need, offers)` per need, cheapest per useful byte while cheaper than waiting; what it buys is
   returned, and so is every decision that buys no memory (DropInstanceLayers of a bought group,
   restores, dissolves, PlacePrewarm, ScaleDown, ReportIdle), unchanged;
4. keeps a `PlanPurchased` per need; the caller gets them with the bought effects' plan ids from
   `take_purchases(effects)` right after `core.step` (the core names effects; matching is by effect key,
   unique among effects in flight) and publishes them before the effects' PlanDecided.

What counts as a purchase: a kv-pressure decision (FormGroup, a Migrate with trigger kv_pressure) always
is — with no need in its scope it is not bought; a ScaleUp, a ReleasePrewarm, a ReleaseAdapter or a
consolidating Migrate is an offer when its scope has a need, and otherwise the mechanism's own rule
(autoscaling, Alg. 1, consolidation) and passes through. A migration into a needy worker is not bought.
A decision not bought is dropped; its policy hears of it through the optional `on_declined(decision)`
(KunServe forgets the group it planned, WarmServe the start) and proposes again next interval, re-priced.

Faults: an effect bought here that fails or is cancelled is not bought again blindly: its offer
(source, target) is left out for one horizon and the need is re-priced from the next view; offers on
dead workers are never made (the view's usable workers only). Outcomes, placement hints and follow-ups
go to and come from the wrapped policy that proposed the effect.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import msgspec

from shared.events.plan import (
    FormGroup, Migrate, PlacementHints, PlanApplied, PlanOutcome, PlanPurchased, ReleaseAdapter, ReleasePrewarm,
    ScaleUp, SourcePrice,
)
from shared.planner import arbiter_offers as price
from shared.planner.arbiter_capacity import capacity_offers
from shared.planner.arbiter_drain import DrainMeter
from shared.planner.arbiter_offers import Pricing
from shared.planner.arbiter_prefix import cut_prefix, prefix_offers
from shared.planner.effects import Decision, Effect, EffectKey, action_of, key, workers_of
from shared.planner.policy import Busy, Policy, hints_of, notify
from shared.planner.view import ClusterView
from shared.policy.memory_market import Need, Offer, Purchase, Source, buy


@dataclass(frozen=True)
class Proposal:
    """A decision on the market: who proposed it (None: the arbiter), its source and target."""

    policy: Policy | None
    decision: Decision
    source: Source
    target: str

    @property
    def key(self) -> EffectKey:
        return key(self.decision.action)


class _Taken(Busy):
    """The core's in-flight keys plus the keys proposed earlier in this call."""

    def __init__(self, base: Busy, taken: set[EffectKey]) -> None:
        super().__init__(())
        self.base, self.taken = base, taken

    def has(self, k: EffectKey) -> bool:
        return self.base.has(k) or k in self.taken

    def request(self, request_id: str) -> bool:
        return self.base.request(request_id) or ("request", request_id) in self.taken

    def __len__(self) -> int:
        return len(self.base) + len(self.taken)


class ArbiterPolicy:
    name = "arbiter"

    def __init__(self, policies: Sequence[Policy], pricing: Pricing, *, id_prefix: str = "buy") -> None:
        self.policies = list(policies)
        self.pricing = pricing
        self.horizon_s = pricing.settings.horizon_s
        self.drain = DrainMeter(self.horizon_s)  # waiting's drain, measured from the views (issue 32)
        self.id_prefix = id_prefix
        self.owner: dict[EffectKey, Policy] = {}  # decisions handed to the core -> the policy that proposed it
        self.bought: dict[EffectKey, tuple[str, str]] = {}  # bought, in flight -> (source, target)
        self.cooldown: dict[tuple[str, str], float] = {}  # (source, target) of a failed purchase -> until
        self.counts: Counter[str] = Counter()  # bought_<source>, declined, purchases
        self._pending: list[tuple[PlanPurchased, list[EffectKey | None]]] = []
        self._n = 0

    # --- the Policy protocol ----------------------------------------------------------------
    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        self._pending = []
        for k in [k for k, until in self.cooldown.items() if until <= view.now]:
            del self.cooldown[k]
        asked = self._ask(view, busy, "decide")
        needs = price.find_needs(view, self.pricing.settings, self.pricing.prefill, self.drain.observe(view))
        scopes = {n.scope: n for n in needs}
        passing: list[tuple[Policy | None, Decision]] = []
        offers: dict[str, list[Offer]] = {n.scope: [] for n in needs}
        declined: list[tuple[Proposal, str]] = []
        for policy, decision in asked:
            verdict = self._classify(view, policy, decision, scopes)
            if verdict is None:
                passing.append((policy, decision))
            elif isinstance(verdict, str):
                declined.append((Proposal(policy, decision, "queue", ""), verdict))
            else:
                for scope, offer in verdict:
                    offers[scope].append(offer)
        taken = {key(d.action) for _, d in asked} | {k for k in self.bought}
        for need in needs:
            offers[need.scope] += self._own_offers(view, need, busy, taken)
        chosen = self._buy(view, needs, offers)
        for k, prop in chosen.items():
            self.bought[k] = (prop.source, prop.target)
        for offer_list in offers.values():
            for offer in offer_list:
                prop: Proposal = offer.payload  # type: ignore[assignment]
                if prop.key not in chosen and prop.policy is not None:
                    declined.append((prop, "not bought: waiting or another offer is cheaper"))
        self._decline(declined, chosen)
        out = [(p.policy, p.decision) for p in chosen.values()] + passing
        return self._hand_over(out)

    def follow_ups(self, view: ClusterView, busy: Busy) -> list[Decision]:
        """The wrapped policies' next steps right after an outcome (KunServe's drops once its group formed):
        they carry out what was bought, so they pass through."""
        return self._hand_over(self._ask(view, busy, "follow_ups"))

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        k = key(action_of(effect))
        owner, bought = self.owner.pop(k, None), self.bought.pop(k, None)
        if bought is not None and not isinstance(outcome, PlanApplied):
            self.cooldown[bought] = outcome.ts + self.horizon_s  # re-priced from a later view, without it
        if owner is not None:
            notify(owner, effect, outcome)

    def placement_hints(self, view: ClusterView) -> list[PlacementHints]:
        return [h for policy in self.policies for h in hints_of(policy, view)]

    # --- purchases out --------------------------------------------------------------------
    def take_purchases(self, effects: Iterable[Effect]) -> list[PlanPurchased]:
        """This interval's purchases, each bought offer with the plan id the core gave its effect."""
        ids = {key(action_of(e)): e.plan_id for e in effects}
        out = []
        for purchase, keys in self._pending:
            prices = [msgspec.structs.replace(sp, plan_ids=[ids[k]]) if k is not None and k in ids else sp
                      for sp, k in zip(purchase.prices, keys)]
            out.append(msgspec.structs.replace(purchase, prices=prices))
        self._pending = []
        return out

    # --- asking and classifying -----------------------------------------------------------
    def _ask(self, view: ClusterView, busy: Busy, hook: str) -> list[tuple[Policy, Decision]]:
        taken: set[EffectKey] = set()
        out: list[tuple[Policy, Decision]] = []
        for policy in self.policies:
            method = getattr(policy, hook, None)
            if method is None:
                continue
            for decision in method(view, _Taken(busy, taken)):
                k = key(decision.action)
                if busy.has(k) or k in taken:
                    continue  # the core would drop it: never two effects on one key
                taken.add(k)
                out.append((policy, decision))
        return out

    def _classify(self, view: ClusterView, policy: Policy, d: Decision,
                  needs: dict[str, Need]) -> None | str | list[tuple[str, Offer]]:
        """None: not a purchase (passes through); a string: a purchase declined (why); else its offers."""
        a = d.action
        if isinstance(a, FormGroup):
            freed = {f"worker:{w}": b for w, b in price.group_freed(view, a).items() if b > 0}
            return self._offers(view, policy, d, "layers", "+".join(sorted({m.worker_id for m in a.members})),
                                {s: b for s, b in freed.items() if s in needs}, price.layer_price(view, self.pricing, a))
        if isinstance(a, Migrate):
            scope = f"worker:{a.source}"
            if f"worker:{a.destination}" in needs:
                return "not bought: its destination needs memory itself"
            if d.trigger != "kv_pressure" and scope not in needs:
                return None  # consolidation (MELL): no need asks for it
            req = view.request(a.request_id)
            return self._offers(view, policy, d, "migrate", a.request_id,
                                {scope: req.kv_bytes} if req is not None and scope in needs else {},
                                price.migration_price(view, self.pricing, a))
        if isinstance(a, ScaleUp) and (need := needs.get(f"model:{a.model}")) is not None:
            made = price.scale_out(view, self.pricing, a, need.waiting, need.slack_s)
            return self._offers(view, policy, d, "scale_out", f"{a.worker_id}/{a.model}",
                                {need.scope: made[0]} if made else {}, made[1] if made else None,
                                after_s=made[2] if made else 0.0)
        if isinstance(a, ReleasePrewarm) and f"worker:{a.worker_id}" in needs:
            return self._offers(view, policy, d, "prewarm", f"{a.worker_id}/{a.model}",
                                {f"worker:{a.worker_id}": view.workers[a.worker_id].prewarmed.get(a.model, 0)},
                                price.prewarm_price(view, self.pricing, view.workers[a.worker_id], a.model))
        if isinstance(a, ReleaseAdapter) and f"worker:{a.worker_id}" in needs:
            worker = view.workers[a.worker_id]
            held = next((x for x in worker.adapters if x.adapter == a.adapter), None)
            return self._offers(view, policy, d, "adapter", f"{a.worker_id}/{a.adapter}",
                                {f"worker:{a.worker_id}": held.bytes} if held else {},
                                price.adapter_price(view, self.pricing, worker, held) if held else None,
                                lasts_s=price.until_next_use(view, a.adapter))
        return None

    def _offers(self, view: ClusterView, policy: Policy | None, d: Decision, source: Source, target: str,
                bytes_by_scope: dict[str, int], cost: float | None, divisible: bool = False,
                after_s: float = 0.0, lasts_s: float = math.inf) -> str | list[tuple[str, Offer]]:
        if any(not view.alive(w) for w in workers_of(d.action)):
            return "not bought: a worker it needs is dead"
        if (source, target) in self.cooldown:
            return f"not bought: {source} {target} failed within the last {self.horizon_s:g}s"
        if cost is None or not bytes_by_scope:
            return "not bought: no need it serves, or no price for it"
        prop = Proposal(policy, d, source, target)
        return [(scope, Offer(source, target, b, cost, prop, divisible, after_s, lasts_s))
                for scope, b in sorted(bytes_by_scope.items()) if b > 0]

    def _own_offers(self, view: ClusterView, need: Need, busy: Busy, taken: set[EffectKey]) -> list[Offer]:
        """What the fixed order leaves to the worker's pool: its prewarmed replicas and cold adapters; and its
        instances' cached-free prefix blocks."""
        kind, _, wid = need.scope.partition(":")
        if kind == "model":  # capacity on the market: an under-loaded model's instance scaled down
            out: list[Offer] = []
            for co in capacity_offers(view, self.pricing, need):
                if key(co.decision.action) not in taken and not busy.has(key(co.decision.action)):
                    made = self._offers(view, None, co.decision, "scale_out", co.target, {need.scope: co.bytes},
                                        co.price, after_s=co.after_s)
                    out += [o for _, o in made] if isinstance(made, list) else []
            return out
        if kind != "worker":
            return []
        worker, out = view.workers[wid], []
        for model in sorted(worker.prewarmed):
            d = Decision(action=ReleasePrewarm(worker_id=wid, model=model), trigger="kv_pressure",
                         freed_bytes=worker.prewarmed[model], reason=f"the arbiter releases {model}'s warm weights on {wid}")
            if key(d.action) not in taken and not busy.has(key(d.action)):
                made = self._offers(view, None, d, "prewarm", f"{wid}/{model}", {need.scope: worker.prewarmed[model]},
                                    price.prewarm_price(view, self.pricing, worker, model))
                out += [o for _, o in made] if isinstance(made, list) else []
        for held in worker.adapters:
            d = Decision(action=ReleaseAdapter(worker_id=wid, adapter=held.adapter), trigger="kv_pressure",
                         freed_bytes=held.bytes, reason=f"the arbiter evicts adapter {held.adapter} on {wid}")
            if key(d.action) not in taken and not busy.has(key(d.action)):
                made = self._offers(view, None, d, "adapter", f"{wid}/{held.adapter}", {need.scope: held.bytes},
                                    price.adapter_price(view, self.pricing, worker, held),
                                    lasts_s=price.until_next_use(view, held.adapter))
                out += [o for _, o in made] if isinstance(made, list) else []
        for po in prefix_offers(view, self.pricing, need):
            if key(po.decision.action) not in taken and not busy.has(key(po.decision.action)):
                made = self._offers(view, None, po.decision, "prefix", po.target, {need.scope: po.bytes}, po.price,
                                    divisible=True)
                out += [o for _, o in made] if isinstance(made, list) else []
        return out

    # --- buying ---------------------------------------------------------------------------
    def _buy(self, view: ClusterView, needs: list[Need], offers: dict[str, list[Offer]]) -> dict[EffectKey, Proposal]:
        """Each need in turn (workers, then models); an offer bought for one is not sold again, and what it
        frees on another need's scope (a group's other members) counts there."""
        chosen: dict[EffectKey, Proposal] = {}
        freed: Counter[str] = Counter()
        for need in needs:
            before = freed[need.scope]
            left = replace(need, bytes=max(0, need.bytes - before))
            purchase = buy(left, [o for o in offers[need.scope] if o.payload.key not in chosen])  # type: ignore[union-attr]
            for offer in purchase.bought:
                prop: Proposal = offer.payload  # type: ignore[assignment]
                chosen[prop.key] = cut_prefix(prop, offer.bytes) if offer.source == "prefix" else prop
                for scope, others in offers.items():
                    freed[scope] += sum(offer.bytes if o.divisible else o.bytes for o in others if o.payload is prop)
                self.counts[f"bought_{prop.source}"] += 1
            self._record(view, purchase, before)
        return chosen

    def _record(self, view: ClusterView, p: Purchase, covered_before: int) -> None:
        self._n += 1
        self.counts["purchases"] += 1
        bought = {id(o.payload): o for o in p.bought}  # a divisible offer is bought cut: the same payload
        shown = [bought.get(id(o.payload), o) for o in p.offers]
        prices = [SourcePrice(source=o.source, target=o.target[:512], bytes=o.bytes, price_request_s=o.price,
                              bought=id(o.payload) in bought) for o in shown]
        keys = [o.payload.key if id(o.payload) in bought else None for o in p.offers]  # type: ignore[union-attr]
        short = max(0, p.need.bytes - p.bought_bytes)
        why = (f"bought {len(p.bought)} of {len(p.offers)} offers: {p.bought_bytes} of {p.need.bytes} B"
               if p.bought else f"nothing cheaper than waiting among {len(p.offers)} offers")
        if short:
            why += f"; {short} B wait"
        if covered_before > 0:
            why += f"; {covered_before} B already freed by another need's purchase"
        self._pending.append((PlanPurchased(
            purchase_id=f"{self.id_prefix}-{self._n}", ts=view.now, scope=p.need.scope[:256], need_bytes=p.need.bytes,
            horizon_s=p.need.horizon_s, waiting=p.need.waiting, reserve_request_s_per_byte=p.reserve_unit_price,
            prices=prices, bought_bytes=p.bought_bytes, price_request_s=p.price, reason=why[:2000]), keys))

    def _decline(self, declined: list[tuple[Proposal, str]], chosen: dict[EffectKey, Proposal]) -> None:
        seen: set[EffectKey] = set()
        for prop, why in declined:
            if prop.key in chosen or prop.key in seen:
                continue
            seen.add(prop.key)
            self.counts["declined"] += 1
            hook = getattr(prop.policy, "on_declined", None)
            if hook is not None:
                hook(prop.decision, why)

    def _hand_over(self, decisions: list[tuple[Policy | None, Decision]]) -> list[Decision]:
        out = []
        for policy, decision in decisions:
            if policy is not None:
                self.owner[key(decision.action)] = policy
            out.append(decision)
        return out


__all__ = ["ArbiterPolicy", "Proposal"]
