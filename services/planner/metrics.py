"""The planner's Prometheus metrics (served on its /metrics with the bus and actor metrics)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import REGISTRY

EFFECTS = Counter(
    "tidal_plan_effects_total",
    "Planner effects by kind (migrate, report_idle, ...) and outcome (decided, applied, failed, cancelled)",
    ["kind", "outcome"], registry=REGISTRY,
)
MIGRATIONS = Counter(
    "tidal_planner_migrations_total",
    "Migrations the planner sent, by the mode it asked for and how they ended (applied, failed, stale)",
    ["mode", "outcome"], registry=REGISTRY,
)
SKIPPED = Counter(
    "tidal_planner_skipped_total",
    "Inputs and outcomes the planner skipped, by reason (late_outcome, stale_stats, refused_<code>, unreachable)",
    ["reason"], registry=REGISTRY,
)
LEADER = Gauge("tidal_planner_leader", "1 while this planner holds the lease and decides", registry=REGISTRY)
TICKS = Counter("tidal_planner_ticks_total", "Planning intervals run while leader", registry=REGISTRY)
PURCHASES = Counter(
    "tidal_planner_purchases_total",
    "Memory the arbiter bought ([planner] economy = arbiter), by source (prefix, prewarm, adapter, layers, migrate, "
    "scale_out; queue: a need, or its part, left waiting because nothing was cheaper)",
    ["source"], registry=REGISTRY,
)
PURCHASE_OUTCOMES = Counter(
    "tidal_planner_purchase_outcomes_total",
    "How the effects of bought offers ended, by source, outcome (applied, refused, failed) and reason (the "
    "worker's refusal code, stale, cancelled, expired)",
    ["source", "outcome", "reason"], registry=REGISTRY,
)
PURCHASE_PRICE = Histogram(
    "tidal_planner_purchase_price_request_s",
    "What each need cost, in request-seconds: the offers bought plus waiting for the part not covered",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0), registry=REGISTRY,
)
