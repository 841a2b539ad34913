"""`python -m services.planner`: the planner (docs/planner.md).

Subscribes to worker stats, liveness and the catalog; every `[planner] interval` the lease holder
runs the pure PlannerCore (shared/planner) and applies its effects with ctl commands, publishing
every effect on `tidal.v1.evt.plan.<kind>`. `[planner] enabled = false`: it runs and decides nothing.
"""
from __future__ import annotations

from shared.bootstrap import bootstrap
from shared.service import run

from services.planner.actor import Planner


def main() -> None:
    boot = bootstrap("planner")
    boot.service.add_actor(Planner(boot.config, boot.service.settings.instance))
    boot.announce()
    run(boot.service)


if __name__ == "__main__":
    main()
