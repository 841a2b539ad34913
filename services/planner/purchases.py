"""The arbiter's purchases on the live planner: counted, kept (the last 64) and answered on request.

Each `PlanPurchased` is published on `tidal.v1.evt.plan.purchased` before the PlanDecided of the effects
it bought (the actor does that); `PurchaseLog` keeps the latest ones for `tidal.v1.planner.purchases`
(`PurchaseLogRequest` -> `PurchaseLogReply`, newest first), which the planner subscribes to only while
it holds the lease: two planners never both answer.

Outcomes: each bought offer's effect ends applied / refused / failed (shared/planner/purchase_outcomes.py,
matched by plan id); `ended(outcome)` counts it (`tidal_planner_purchase_outcomes_total{source,outcome,reason}`),
marks it on the kept purchase's price line, and the reply carries the counts since start.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Literal

import msgspec

from shared.events.plan import PlanOutcome, PlanPurchased, PurchaseLogReply, PurchaseLogRequest
from shared.logging import get_logger
from shared.planner.purchase_outcomes import PurchaseOutcomes

from services.planner import metrics

KEPT = 64
log = get_logger("tidal.planner.purchases")


class PurchaseLog:
    def __init__(self, planner_id: str, economy: Literal["fixed-order", "arbiter"], kept: int = KEPT) -> None:
        self.planner_id = planner_id
        self.economy = economy
        self._latest: deque[PlanPurchased] = deque(maxlen=kept)
        self.outcomes = PurchaseOutcomes()

    def record(self, purchases: Iterable[PlanPurchased]) -> None:
        purchases = list(purchases)
        self.outcomes.bought(purchases)
        for p in purchases:
            self._latest.append(p)
            for price in p.prices:
                if price.bought:
                    metrics.PURCHASES.labels(price.source).inc()
            if p.bought_bytes < p.need_bytes:
                metrics.PURCHASES.labels("queue").inc()
            metrics.PURCHASE_PRICE.observe(p.price_request_s)

    def ended(self, outcome: PlanOutcome) -> None:
        """An effect ended: if a purchase bought it, count how and mark it on the kept purchase."""
        got = self.outcomes.ended(outcome)
        if got is None:
            return
        purchase_id, source, how, reason = got
        metrics.PURCHASE_OUTCOMES.labels(source, how, reason).inc()
        if how != "applied":
            log.info("purchase not applied", purchase_id=purchase_id, plan_id=outcome.plan_id, source=source,
                     outcome=how, reason=reason)
        for i, p in enumerate(self._latest):
            if p.purchase_id != purchase_id:
                continue
            prices = [msgspec.structs.replace(sp, outcome=how, outcome_reason=reason)
                      if outcome.plan_id in sp.plan_ids else sp for sp in p.prices]
            self._latest[i] = msgspec.structs.replace(p, prices=prices)
            break

    def reply(self, request: PurchaseLogRequest) -> PurchaseLogReply:
        newest = list(reversed(self._latest))[: request.limit]
        return PurchaseLogReply(planner_id=self.planner_id, economy=self.economy, purchases=newest,
                                outcomes=self.outcomes.rows()[:1024], in_flight=len(self.outcomes.open))

    def __len__(self) -> int:
        return len(self._latest)


__all__ = ["KEPT", "PurchaseLog"]
