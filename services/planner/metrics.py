"""The planner's Prometheus metrics (served on its /metrics with the bus and actor metrics)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge

from shared.metrics import REGISTRY

EFFECTS = Counter(
    "tidal_plan_effects_total",
    "Planner effects by kind (migrate, report_idle, ...) and outcome (decided, applied, failed, cancelled)",
    ["kind", "outcome"], registry=REGISTRY,
)
MIGRATIONS = Counter(
    "tidal_planner_migrations_total",
    "Migrations the planner sent, by the mode it asked for and how they ended (applied, failed)",
    ["mode", "outcome"], registry=REGISTRY,
)
SKIPPED = Counter(
    "tidal_planner_skipped_total",
    "Inputs and outcomes the planner skipped, by reason (late_outcome, stale_stats, refused_<code>, unreachable)",
    ["reason"], registry=REGISTRY,
)
LEADER = Gauge("tidal_planner_leader", "1 while this planner holds the lease and decides", registry=REGISTRY)
TICKS = Counter("tidal_planner_ticks_total", "Planning intervals run while leader", registry=REGISTRY)
