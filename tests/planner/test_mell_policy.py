"""The MELL adapter on constructed views: consolidation, KV pressure, migration modes and budgets,
idle workers, and the `[policies] migration = off` switch."""
from __future__ import annotations

from dataclasses import replace

from views import BLOCK, view, worker

from shared.events.plan import Migrate, PlanApplied, PlanFailed, ReportIdle
from shared.planner import ClusterView, Effect, PlannerCore, RequestView
from shared.planner.mell_policy import MellPolicy


def apply_moves(v: ClusterView, effects: list[Effect], now: float) -> ClusterView:
    """The view after the migrations ran: each moved request now runs on its destination."""
    moving = {a.request_id: a for e in effects for a in e.actions if isinstance(a, Migrate)}
    carried: dict[str, list[RequestView]] = {}
    workers = {}
    for w in v.workers.values():
        (inst,) = w.instances
        stay = tuple(r for r in inst.requests if r.request_id not in moving)
        for r in inst.requests:
            if r.request_id in moving:
                carried.setdefault(moving[r.request_id].destination, []).append(r)
        workers[w.worker_id] = (w, inst, stay)
    out = []
    for wid, (w, inst, stay) in workers.items():
        reqs = stay + tuple(carried.get(wid, ()))
        used = sum(r.kv_bytes for r in reqs) // BLOCK
        out.append(replace(w, instances=(replace(inst, requests=reqs, kv_blocks_used=used),)))
    return view(now, *out, link=v.default_link_budget_bytes, prefill=v.default_prefill_budget_tokens)


def run(core: PlannerCore, v: ClusterView) -> tuple[list[Effect], ClusterView]:
    effects = core.step(v)
    after = apply_moves(v, effects, v.now + 0.5)
    for e in effects:
        core.dispatched(e.plan_id)
        core.on_outcome(PlanApplied(plan_id=e.plan_id, ts=v.now + 0.5, duration_s=0.5))
    return effects, after


def migrations(effects: list[Effect]) -> list[Migrate]:
    return [a for e in effects for a in e.actions if isinstance(a, Migrate)]


def active(v: ClusterView) -> set[str]:
    return {w.worker_id for w in v.workers.values() if w.requests}


def fragmented(now: float = 0.0, **budgets: float) -> ClusterView:
    """Long (40-block) and short (10-block) requests spread one or two per worker over four workers."""
    return view(now, worker("w0", {"long0": 40, "short0": 10}), worker("w1", {"long1": 40}),
                worker("w2", {"short1": 10}), worker("w3", {"short2": 10, "short3": 10}), **budgets)


def test_a_fragmented_cluster_is_consolidated_and_emptied_workers_are_reported_idle() -> None:
    core = PlannerCore([MellPolicy()])
    first, v = run(core, fragmented())
    moves = migrations(first)
    assert moves and all(e.trigger == "fragmentation" for e in first if isinstance(e.actions[0], Migrate))
    assert len(active(v)) <= 2 < len(active(fragmented()))  # 4 active workers -> at most 2
    assert all(w.kv_usage <= 0.9 for w in v.workers.values())  # never packed past the watermark
    assert len({m.request_id for m in moves}) == len(moves)  # one move per request
    second, v2 = run(core, replace(v, now=1.0))
    assert migrations(second) == []  # stable: nothing moves once reality matches MELL's placement
    idle = {a.worker_id for e in second for a in e.actions if isinstance(a, ReportIdle)}
    assert idle == set(v.workers) - active(v)
    third, _ = run(core, replace(v2, now=2.0))
    assert third == []  # an idle worker is reported once per idle spell


def test_a_worker_above_the_watermark_gets_moves_away_from_it() -> None:
    hot = view(0.0, worker("w0", {f"r{i}": 19 for i in range(5)}), worker("w1", {"x": 10}))
    assert hot.workers["w0"].kv_usage == 0.95
    effects, after = run(PlannerCore([MellPolicy(kv_high_watermark=0.9)]), hot)
    away = [e for e in effects if isinstance(e.actions[0], Migrate) and e.actions[0].source == "w0"]
    assert away and all(e.trigger == "kv_pressure" for e in away)
    assert after.workers["w0"].kv_usage <= 0.9


def test_migration_off_moves_nothing() -> None:
    effects, _ = run(PlannerCore([MellPolicy(migration="off")]), fragmented())
    assert migrations(effects) == []


def test_modes_follow_the_budgets_and_what_fits_neither_waits_for_the_next_interval() -> None:
    by_tokens = migrations(PlannerCore([MellPolicy()]).step(fragmented(link=0.0, prefill=1e9)))
    assert by_tokens and {m.mode for m in by_tokens} == {"tokens"}
    by_kv = migrations(PlannerCore([MellPolicy()]).step(fragmented(link=1e12, prefill=0.0)))
    assert by_kv and {m.mode for m in by_kv} == {"kv"}
    forced = migrations(PlannerCore([MellPolicy(migration="kv")]).step(fragmented(link=1e12, prefill=1e9)))
    assert forced and {m.mode for m in forced} == {"kv"}
    core = PlannerCore([MellPolicy()])
    assert migrations(core.step(fragmented(link=0.0, prefill=0.0))) == []  # no budget: all deferred
    assert migrations(core.step(fragmented(1.0, link=1e12, prefill=1e9)))  # budget back: they go


def test_a_request_whose_migration_keeps_failing_is_left_where_it_runs() -> None:
    policy = MellPolicy(max_attempts=2)
    core = PlannerCore([policy])
    v = fragmented()
    for attempt in range(3):
        effects = core.step(replace(v, now=float(attempt)))
        for e in effects:
            core.on_outcome(PlanFailed(plan_id=e.plan_id, ts=attempt + 0.5, action_index=0, message="refused"))
        if attempt == 0:
            tried = {m.request_id for m in migrations(effects)}
    assert tried and not ({m.request_id for m in migrations(effects)} & tried)


def test_a_growth_that_fits_nowhere_then_a_vanishing_request_leave_mell_consistent() -> None:
    """Live: a request's update fit nowhere, then it vanished for an interval (a token hand-over) and
    came back. MELL's state and the policy's must not part ways (they did: every later step raised)."""
    policy = MellPolicy()
    core = PlannerCore([policy])
    full = {"a": 44, "b": 44}, {"c": 44, "d": 44}  # four M requests: two per device, both devices full
    core.step(view(0.0, worker("w0", full[0]), worker("w1", full[1]), link=0.0, prefill=0.0))
    grown = view(1.0, worker("w0", {**full[0], "a": 60}), worker("w1", full[1]), link=0.0, prefill=0.0)
    core.step(grown)  # a at 60 blocks (class L) fits on no device
    core.step(view(2.0, worker("w0", {"b": 44}), worker("w1", full[1]), link=0.0, prefill=0.0))  # a is away
    core.step(replace(grown, now=3.0))  # and back
    core.step(replace(grown, now=4.0))
    state = policy.models["m"]
    assert all(state.scheduler.device_of(rid) is not None for rid in state.sizes)
    held = {rid for w in ("w0", "w1") for rid in state.scheduler.requests_on(w)}
    assert held == set(state.sizes), (held, state.sizes)


def test_a_request_missing_from_the_view_right_after_its_move_does_not_depart() -> None:
    """Live, a migrated request is in no worker's stats for a moment (the destination's predate the
    commit). Departing it then re-allocates it on its return, and MELL moves it again for nothing."""
    policy = MellPolicy()
    core = PlannerCore([policy])
    effects = core.step(view(0.0, worker("w0", {"a": 10}), worker("w1", {"b": 10})))
    (move,) = migrations(effects)
    for e in effects:
        core.dispatched(e.plan_id)
        core.on_outcome(PlanApplied(plan_id=e.plan_id, ts=0.5, duration_s=0.5))
    other = "b" if move.request_id == "a" else "a"
    gone = view(0.6, worker(move.destination, {other: 10}), worker(move.source, {}))
    assert migrations(core.step(gone)) == []
    assert move.request_id in policy.models["m"].sizes  # not departed while its move is young
    back = view(1.0, worker(move.destination, {other: 10, move.request_id: 10}), worker(move.source, {}))
    assert migrations(core.step(back)) == []
    assert policy.models["m"].scheduler.device_of(move.request_id) == move.destination


def test_a_destination_that_measured_a_slow_prefill_takes_moves_as_kv_not_as_a_long_re_prefill() -> None:
    """Token mode re-prefills the moved request at the destination: with the configured 4096 tokens per interval
    a CPU worker (~250 tokens/s) would queue many seconds of prefill ahead of its own requests."""
    def paced(v: ClusterView, pace: float) -> ClusterView:
        workers = [replace(w, instances=tuple(replace(i, prefill_tokens_per_s=pace) for i in w.instances))
                   for w in v.workers.values()]
        return view(v.now, *workers, link=1e12, prefill=4096)

    unmeasured = paced(fragmented(), 0.0)
    assert unmeasured.prefill_budget("w0", "m") == 4096 - unmeasured.workers["w0"].instances[0].queued_prompt_tokens
    assert {m.mode for m in migrations(PlannerCore([MellPolicy()]).step(unmeasured))} == {"tokens"}
    slow = paced(fragmented(), 50.0)  # 50 tokens per 1 s interval: fewer than any moved request holds (80+)
    assert slow.prefill_budget("w0", "m") == 50.0
    assert slow.prefill_budget("w0", "other") == 4096  # another model's pace is not known there
    moves = migrations(PlannerCore([MellPolicy()]).step(slow))
    assert moves and {m.mode for m in moves} == {"kv"}


def test_without_consolidation_only_requests_on_a_worker_above_the_watermark_move() -> None:
    """Under a load-spreading router (`[planner] consolidate = "auto"` without `mell` routing) MELL does not pack
    the requests the router spread; it still relieves a worker above the KV high watermark."""
    assert not migrations(PlannerCore([MellPolicy(consolidate=False)]).step(fragmented()))
    assert migrations(PlannerCore([MellPolicy()]).step(fragmented()))
    hot = view(0.0, worker("w0", {"a": 50, "b": 45}), worker("w1", {"c": 10}))  # w0 at 95% > 90%
    moves = migrations(PlannerCore([MellPolicy(consolidate=False)]).step(hot))
    assert moves and {m.source for m in moves} == {"w0"}


def test_consolidation_follows_the_router_unless_the_config_says() -> None:
    from services.planner.policies import consolidates
    from shared.config import load_config

    def config(**env: str) -> bool:
        return consolidates(load_config(env={f"TIDAL__{k.replace('_', '__', 1).upper()}": v for k, v in env.items()}))

    assert not config()  # the embedded default: least-load routing
    assert config(dispatcher_routing_policy="mell")
    assert config(planner_consolidate="on")
    assert not config(dispatcher_routing_policy="mell", planner_consolidate="off")


def test_a_forced_token_mode_keeps_the_configured_budget_whatever_the_pace() -> None:
    slow = fragmented(link=1e12, prefill=4096)
    slow = view(0.0, *[replace(w, instances=tuple(replace(i, prefill_tokens_per_s=50.0) for i in w.instances))
                       for w in slow.workers.values()], link=1e12, prefill=4096)
    moves = migrations(PlannerCore([MellPolicy(migration="tokens")]).step(slow))
    assert moves and {m.mode for m in moves} == {"tokens"}
