"""How the arbiter's purchases ended (shared/planner/purchase_outcomes.py, pure), the planner's purchase
log that counts them (services/planner/purchases.py) and `tidal status` showing them."""
from __future__ import annotations

import msgspec

from services.planner.purchases import PurchaseLog
from shared.events.plan import (
    PlanApplied, PlanCancelled, PlanFailed, PlanPurchased, PurchaseLogReply, PurchaseLogRequest, SourcePrice,
)
from shared.planner.purchase_outcomes import PurchaseOutcomes, outcome_of, summary
from tidal.commands.status_view import render_to_string
from test_status_economy import line_of, with_purchases

MiB = 1 << 20


def bought(pid: str, *offers: tuple[str, str, str]) -> PlanPurchased:
    """offers: (source, target, plan id); a fourth one not bought."""
    prices = [SourcePrice(source=s, target=t, bytes=MiB, price_request_s=0.1, bought=True, plan_ids=[e])  # type: ignore[arg-type]
              for s, t, e in offers]
    prices.append(SourcePrice(source="layers", target="w0+w1", bytes=8 * MiB, price_request_s=9.0))
    return PlanPurchased(purchase_id=pid, ts=990.0, scope="worker:w0", need_bytes=4 * MiB, horizon_s=10.0, waiting=2,
                         reserve_request_s_per_byte=1e-6, prices=prices, bought_bytes=len(offers) * MiB)


def failed(plan_id: str, message: str, refused=None) -> PlanFailed:  # type: ignore[no-untyped-def]
    return PlanFailed(plan_id=plan_id, ts=1.0, action_index=0, message=message, refused=refused)


def test_each_outcome_is_applied_refused_with_its_code_or_failed() -> None:
    assert outcome_of(PlanApplied(plan_id="e", ts=1.0, duration_s=0.1)) == ("applied", "")
    assert outcome_of(failed("e", "OffloadAdapter refused by w0 (busy): ...", "busy")) == ("refused", "busy")
    assert outcome_of(PlanCancelled(plan_id="e", ts=1.0, message="stale: r1 ended")) == ("refused", "stale")
    assert outcome_of(PlanCancelled(plan_id="e", ts=1.0, message="lost the lease")) == ("refused", "cancelled")
    assert outcome_of(failed("e", "expired: no outcome came back in time")) == ("failed", "expired")
    assert outcome_of(failed("e", "MigrateOut to w0 got no answer: no worker listens")) == ("failed", "")


def test_outcomes_are_matched_to_purchases_by_plan_id_and_counted_by_source() -> None:
    tally = PurchaseOutcomes()
    tally.bought([bought("b1", ("adapter", "w0/a", "e1"), ("adapter", "w0/b", "e2")),
                  bought("b2", ("migrate", "r1", "e3"))])
    assert tally.ended(PlanApplied(plan_id="other", ts=1.0, duration_s=0.1)) is None  # not a purchase's
    assert tally.ended(PlanApplied(plan_id="e1", ts=1.0, duration_s=0.1)) == ("b1", "adapter", "applied", "")
    assert tally.ended(failed("e2", "refused", "busy")) == ("b1", "adapter", "refused", "busy")
    assert tally.ended(failed("e2", "again")) is None  # ended once
    assert tally.applied_share() == 0.5 and set(tally.open) == {"e3"}
    tally.ended(failed("e3", "MigrateOut got no answer"))
    assert tally.by_outcome("adapter") == {"applied": 1, "refused": 1, "failed": 0}
    assert tally.by_outcome() == {"applied": 1, "refused": 1, "failed": 1}
    assert summary(tally.rows()) == "applied=33% (1 applied, 1 refused: busy 1, 1 failed)"
    assert summary([]) == ""


def test_the_open_table_is_bounded() -> None:
    tally = PurchaseOutcomes(max_open=2)
    tally.bought([bought("b1", ("adapter", "w0/a", "e1"), ("adapter", "w0/b", "e2"), ("prefix", "w0/i", "e3"))])
    assert list(tally.open) == ["e2", "e3"]  # the oldest forgotten


def test_the_purchase_log_marks_the_line_and_replies_with_the_counts() -> None:
    log = PurchaseLog("planner-a1", "arbiter")
    log.record([bought("b1", ("adapter", "w0/a", "e1"), ("prewarm", "w0/p", "e2"))])
    log.ended(failed("e1", "OffloadAdapter refused by w0 (busy)", "busy"))
    reply = log.reply(PurchaseLogRequest(limit=5))
    (purchase,) = reply.purchases
    assert [(p.outcome, p.outcome_reason) for p in purchase.prices] == [("refused", "busy"), (None, ""), (None, "")]
    assert [(r.source, r.outcome, r.reason, r.count) for r in reply.outcomes] == [("adapter", "refused", "busy", 1)]
    assert reply.in_flight == 1
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=PurchaseLogReply)
    assert wire == reply

    log.ended(PlanApplied(plan_id="e2", ts=2.0, duration_s=0.1))
    text = render_to_string(with_purchases(log.reply(PurchaseLogRequest(limit=5))), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "outcomes: applied=50% (1 applied, 1 refused: busy 1, 0 failed), 0 in flight" in text
    assert line_of(text, "    bought     adapter").split()[-1] == "refused:busy"
    assert line_of(text, "    bought     prewarm").split()[-1] == "applied"
