"""How the arbiter's purchases ended (pure): each bought offer's effect, by plan id, to applied / refused / failed.

A `PlanPurchased` names, per bought offer, the plan ids of the effects that carry it out; each effect then
ends with one `PlanOutcome`. `PurchaseOutcomes` keeps the open plan ids (bought, not ended), and on each
outcome counts it under the offer's source:
- `applied`: `PlanApplied` — the memory was freed (or the start landed);
- `refused`: a worker refused the command (`PlanFailed.refused`: busy, not_found, ...), or the effect was
  cancelled before anything was done (`PlanCancelled`: "stale" when the view it was bought on had gone,
  "cancelled" otherwise, e.g. the lease was lost);
- `failed`: any other `PlanFailed` (no answer, its deadline passed: reason "expired", an error).
The planner's purchase log (services/planner/purchases.py) and the live repro
(loadgen/repro/economy_live.py) both use it, so the two count alike.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from shared.events.plan import (
    MemorySource, PlanApplied, PlanCancelled, PlanFailed, PlanOutcome, PlanPurchased, PurchaseOutcome,
    PurchaseOutcomeCount,
)

MAX_OPEN = 4096  # bought effects tracked at once; older ones are forgotten (their outcome is not counted)


def outcome_of(outcome: PlanOutcome) -> tuple[PurchaseOutcome, str]:
    """(applied | refused | failed, a short reason) for one effect's outcome."""
    if isinstance(outcome, PlanApplied):
        return "applied", ""
    if isinstance(outcome, PlanCancelled):
        return "refused", "stale" if outcome.message.startswith("stale") else "cancelled"
    if isinstance(outcome, PlanFailed) and outcome.refused is not None:
        return "refused", outcome.refused
    return "failed", "expired" if outcome.message.startswith("expired") else ""


class PurchaseOutcomes:
    def __init__(self, max_open: int = MAX_OPEN) -> None:
        self.max_open = max_open
        self.open: dict[str, tuple[str, MemorySource]] = {}  # plan id -> (purchase id, source), insertion order
        self.counts: Counter[tuple[MemorySource, PurchaseOutcome, str]] = Counter()

    def bought(self, purchases: Iterable[PlanPurchased]) -> None:
        for p in purchases:
            for price in p.prices:
                if price.bought:
                    for plan_id in price.plan_ids:
                        self.open[plan_id] = (p.purchase_id, price.source)
        while len(self.open) > self.max_open:
            del self.open[next(iter(self.open))]

    def ended(self, outcome: PlanOutcome) -> tuple[str, MemorySource, PurchaseOutcome, str] | None:
        """(purchase id, source, outcome, reason) when `outcome` ends a bought effect; None otherwise."""
        held = self.open.pop(outcome.plan_id, None)
        if held is None:
            return None
        how, reason = outcome_of(outcome)
        self.counts[(held[1], how, reason)] += 1
        return held[0], held[1], how, reason

    def by_outcome(self, source: str | None = None) -> dict[PurchaseOutcome, int]:
        """Ended effects per outcome (of one source, or all)."""
        out: dict[PurchaseOutcome, int] = {"applied": 0, "refused": 0, "failed": 0}
        for (src, how, _reason), n in self.counts.items():
            if source is None or src == source:
                out[how] += n
        return out

    def applied_share(self) -> float | None:
        """Applied / ended; None when nothing bought has ended."""
        ended = sum(self.counts.values())
        return self.by_outcome()["applied"] / ended if ended else None

    def rows(self) -> list[PurchaseOutcomeCount]:
        return [PurchaseOutcomeCount(source=s, outcome=o, reason=r[:64], count=n)
                for (s, o, r), n in sorted(self.counts.items())]


def summary(rows: Iterable[PurchaseOutcomeCount]) -> str:
    """"applied=NN% (A applied, R refused: busy 3, F failed)" over the rows; "" when none ended."""
    rows = list(rows)
    total = sum(r.count for r in rows)
    if not total:
        return ""
    n = {o: sum(r.count for r in rows if r.outcome == o) for o in ("applied", "refused", "failed")}
    reasons = Counter[str]()
    for r in rows:
        if r.outcome == "refused":
            reasons[r.reason or "?"] += r.count
    why = ", ".join(f"{k} {v}" for k, v in reasons.most_common())
    return (f"applied={100 * n['applied'] / total:.0f}% ({n['applied']} applied, {n['refused']} refused"
            f"{': ' + why if why else ''}, {n['failed']} failed)")


__all__ = ["MAX_OPEN", "PurchaseOutcomes", "outcome_of", "summary"]
