"""The arbiter's purchases on the live planner: counted, kept (the last 64) and answered on request.

Each `PlanPurchased` is published on `tidal.v1.evt.plan.purchased` before the PlanDecided of the effects
it bought (the actor does that); `PurchaseLog` keeps the latest ones for `tidal.v1.planner.purchases`
(`PurchaseLogRequest` -> `PurchaseLogReply`, newest first), which the planner subscribes to only while
it holds the lease: two planners never both answer.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Literal

from shared.events.plan import PlanPurchased, PurchaseLogReply, PurchaseLogRequest

from services.planner import metrics

KEPT = 64


class PurchaseLog:
    def __init__(self, planner_id: str, economy: Literal["fixed-order", "arbiter"], kept: int = KEPT) -> None:
        self.planner_id = planner_id
        self.economy = economy
        self._latest: deque[PlanPurchased] = deque(maxlen=kept)

    def record(self, purchases: Iterable[PlanPurchased]) -> None:
        for p in purchases:
            self._latest.append(p)
            for price in p.prices:
                if price.bought:
                    metrics.PURCHASES.labels(price.source).inc()
            if p.bought_bytes < p.need_bytes:
                metrics.PURCHASES.labels("queue").inc()
            metrics.PURCHASE_PRICE.observe(p.price_request_s)

    def reply(self, request: PurchaseLogRequest) -> PurchaseLogReply:
        newest = list(reversed(self._latest))[: request.limit]
        return PurchaseLogReply(planner_id=self.planner_id, economy=self.economy, purchases=newest)

    def __len__(self) -> int:
        return len(self._latest)


__all__ = ["KEPT", "PurchaseLog"]
