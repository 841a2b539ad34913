"""The planner's packer switch (`[planner] packer`): our RepackFit by default, MELL selectable, through
MellPolicy and PlannerCore on constructed views: consolidation, the watermark, idle workers, hints."""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_mell_hints import by_class
from test_mell_policy import active, fragmented, migrations, run
from views import BLOCK, view, worker

from services.planner.policies import build_policies
from shared.config import ClusterConfig, parse_config
from shared.events.plan import Migrate, ReportIdle
from shared.planner import PlannerCore
from shared.planner.mell_policy import MellPolicy
from shared.policy.mell import MellScheduler
from shared.policy.packer import RepackFit


def _mell_policy(cfg: ClusterConfig) -> MellPolicy:
    (policy,) = [p for p in build_policies(cfg, group_prefix="t") if isinstance(p, MellPolicy)]
    return policy


def test_the_live_default_packer_is_ours_and_mell_stays_selectable() -> None:
    assert ClusterConfig().planner.packer == "repackfit"
    ours, mell = _mell_policy(ClusterConfig()), _mell_policy(parse_config('[planner]\npacker = "mell"\n'))
    core_ours, core_mell = PlannerCore([ours]), PlannerCore([mell])
    core_ours.step(fragmented())
    core_mell.step(fragmented())
    assert isinstance(ours.models["m"].scheduler, RepackFit)
    assert isinstance(mell.models["m"].scheduler, MellScheduler)
    with pytest.raises(ValueError, match="packer"):
        MellPolicy(packer="first-fit")  # type: ignore[arg-type]


def test_ours_consolidates_a_fragmented_cluster_under_the_watermark_and_reports_the_freed_workers() -> None:
    core = PlannerCore([MellPolicy(packer="repackfit")])
    first, v = run(core, fragmented())
    moves = migrations(first)
    assert moves and len({m.request_id for m in moves}) == len(moves)  # one move per request
    assert len(active(v)) <= 2 < len(active(fragmented()))  # 4 active workers -> at most 2
    assert all(w.kv_usage <= 0.9 for w in v.workers.values())  # never packed past the watermark
    second, v2 = run(core, replace(v, now=1.0))
    assert migrations(second) == []  # stable once reality matches the packing
    idle = {a.worker_id for e in second for a in e.actions if isinstance(a, ReportIdle)}
    assert idle == set(v.workers) - active(v)


def test_a_worker_above_the_watermark_is_relieved_by_ours() -> None:
    hot = view(0.0, worker("w0", {f"r{i}": 19 for i in range(5)}), worker("w1", {"x": 10}))
    effects, after = run(PlannerCore([MellPolicy(kv_high_watermark=0.9, packer="repackfit")]), hot)
    away = [e for e in effects if isinstance(e.actions[0], Migrate) and e.actions[0].source == "w0"]
    assert away and all(e.trigger == "kv_pressure" for e in away)
    assert after.workers["w0"].kv_usage <= 0.9


def test_ours_hints_send_a_request_where_it_would_be_allocated_so_it_is_not_migrated() -> None:
    core = PlannerCore([MellPolicy(kv_high_watermark=1.0, packer="repackfit")])
    v = view(0.0, worker("w0", {"big": 60}), worker("w1"), worker("w2"))
    core.step(v)
    got = by_class(core.placement_hints(v)[0])
    assert got["M"] == ("w0", 40 * BLOCK)  # worst fit among the workers in use: w0 has the room
    assert got["L"] == ("w1", 100 * BLOCK)  # fits on no worker in use: the first idle one
    v2 = view(1.0, worker("w0", {"big": 60, "mid": 40}), worker("w1"), worker("w2"))
    assert [a for e in core.step(v2) for a in e.actions if isinstance(a, Migrate)] == []
