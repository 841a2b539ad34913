"""The report's check of MELL's two paths: through the planner core (as live: the dispatcher routes
arrivals by MELL's placement hints, the planner migrates what it would have put elsewhere) against
MellScheduler called directly (a request starts where Allocate puts it)."""
from __future__ import annotations

from loadgen.repro.mell import Scenario
from loadgen.repro.report import md_table
from loadgen.sim.kv_packing_core import CorePackingResult

INTRO = ("MELL runs through PlannerCore + MellPolicy: each planning interval the simulator builds a ClusterView "
         "of its devices, applies the Migrate effects and routes the next interval's arrivals with the "
         "dispatcher's `mell` routing (the placement hints: where Allocate would put each KV size class), falling "
         "back to least load. MELL-direct calls MellScheduler itself. Misroutes: migrations of requests in their "
         "first interval (routed elsewhere than MELL then allocated them); the batching cut is measured on the "
         "direct runs, so it is MELL's own.")


def core_table(scenarios: list[Scenario]) -> str:
    rows = []
    for s in scenarios:
        core, direct = s.results["MELL"], s.results["MELL-direct"]
        routes = core.routes if isinstance(core, CorePackingResult) else {}
        arrivals = sum(routes.values())
        fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(routes.items()) if k != "hinted") or "none"
        misroutes = core.misroutes if isinstance(core, CorePackingResult) else 0
        rows.append((s.testbed.key, s.workload.label,
                     f"{core.peak_devices()} / {direct.peak_devices()}",
                     f"{core.mean_devices():.2f} / {direct.mean_devices():.2f}",
                     f"{core.moves} ({misroutes}) / {direct.moves}",
                     f"{100 * routes.get('hinted', 0) / arrivals:.0f}%" if arrivals else "n/a", fallbacks,
                     f"{core.wall_s:.1f} / {direct.wall_s:.1f}"))
    return md_table(("testbed", "workload", "peak GPUs core/direct", "mean GPUs core/direct",
                     "migrations core (misroutes) / direct", "arrivals hinted", "fallbacks", "wall s core/direct"),
                    rows)


__all__ = ["INTRO", "core_table"]
