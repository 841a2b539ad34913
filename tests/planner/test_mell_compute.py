"""MELL's compute boundary (shared/planner/mell_compute.py) through MellPolicy and PlannerCore on constructed
views: a move goes only where the destination's projected decode step stays within the TPOT SLO."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mell_policy import migrations
from views import view, worker

from services.planner.policies import build_policies
from shared.config import ClusterConfig, parse_config
from shared.events.plan import Migrate, PlanApplied
from shared.planner import ClusterView, PlannerCore
from shared.planner.mell_compute import TpotSlo
from shared.planner.mell_policy import MellPolicy
from shared.planner.view import WorkerView


def decoding(w: WorkerView, tokens_per_s: float, *, waiting: int = 0, ts: float = 0.0) -> WorkerView:
    """The worker's instance as its stats say it decodes: `tokens_per_s` over its running requests."""
    (inst,) = w.instances
    return replace(w, stats_ts=ts, instances=(replace(inst, tokens_per_s=tokens_per_s, waiting=waiting),))


def split(now: float = 0.0, tps: tuple[float, float] = (20.0, 20.0), ts: float = 0.0) -> ClusterView:
    """Issue 35's default cluster in small: six short requests on each of two workers, KV room for all on one."""
    return view(now, decoding(worker("cpu-0", {f"a{i}": 3 for i in range(6)}), tps[0], ts=ts),
                decoding(worker("cpu-1", {f"b{i}": 3 for i in range(6)}), tps[1], ts=ts))


def test_packing_by_bytes_alone_piles_every_request_onto_one_worker() -> None:
    """The behaviour the gate fixes (no SLO given: MELL's packing as the simulator runs it)."""
    moves = migrations(PlannerCore([MellPolicy(packer="repackfit")]).step(split()))
    assert {(m.source, m.destination) for m in moves} == {("cpu-1", "cpu-0")} and len(moves) == 6


def test_no_consolidation_onto_a_worker_whose_step_would_pass_the_slo() -> None:
    # cpu-0: 6 running at 20 tok/s -> a 0.3 s step; one more -> 0.35 s > 0.32 s
    policy = MellPolicy(packer="repackfit", tpot_s=0.32)
    effects = PlannerCore([policy]).step(split())
    assert migrations(effects) == []
    assert set(policy.skipped) == {f"b{i}" for i in range(6)}
    assert all("stays on cpu-1" in why and "> SLO 0.32s" in why for why in policy.skipped.values())
    assert policy.skips["fragmentation"] == 6


def test_a_destination_with_compute_room_takes_moves_up_to_the_slo() -> None:
    # cpu-0: 2 running at 20 tok/s (0.05 s per token): room for 5 in a 0.25 s step -> 3 of cpu-1's 4 move
    v = view(0.0, decoding(worker("cpu-0", {"a0": 3, "a1": 3}), 20.0),
             decoding(worker("cpu-1", {f"b{i}": 3 for i in range(4)}), 20.0))
    policy = MellPolicy(packer="repackfit", tpot_s=0.25)
    effects = PlannerCore([policy]).step(v)
    moves = migrations(effects)
    assert len(moves) == 3 and {m.destination for m in moves} == {"cpu-0"}
    assert len(policy.skipped) == 1
    reasons = [e.reason for e in effects if isinstance(e.actions[0], Migrate)]
    assert all(r.startswith("MELL consolidates onto cpu-0; cpu-0's decode step") and "<= SLO 0.25s" in r
               for r in reasons), reasons


def test_moves_on_their_way_count_against_the_destination_until_its_stats_show_them() -> None:
    v = view(0.0, decoding(worker("cpu-0", {"a0": 3, "a1": 3}), 20.0),
             decoding(worker("cpu-1", {f"b{i}": 3 for i in range(4)}), 20.0))
    policy = MellPolicy(packer="repackfit", tpot_s=0.25)
    core = PlannerCore([policy])
    effects = core.step(v)
    moved = {m.request_id for m in migrations(effects)}
    for e in effects:
        core.dispatched(e.plan_id)
        core.on_outcome(PlanApplied(plan_id=e.plan_id, ts=0.5, duration_s=0.5))
    (left,) = {f"b{i}" for i in range(4)} - moved
    # the moved requests are in neither worker's stats yet (the destination's predate the commit)
    later = view(1.0, decoding(worker("cpu-0", {"a0": 3, "a1": 3}), 20.0),
                 decoding(worker("cpu-1", {left: 3, "b9": 3}), 20.0))
    assert migrations(core.step(later)) == []  # cpu-0 is full by compute: 2 running + 3 arriving
    assert set(policy.skipped) == {left, "b9"}
    assert len(policy.en_route) == 3
    arrived = view(2.0, decoding(worker("cpu-0", {"a0": 3, "a1": 3, **{r: 3 for r in moved}}), 100.0),
                   decoding(worker("cpu-1", {left: 3, "b9": 3}), 20.0))
    core.step(arrived)
    assert not moved & set(policy.en_route)  # counted by cpu-0's stats now, not twice


def test_a_relative_slo_waits_for_the_models_best_steady_step() -> None:
    policy = MellPolicy(packer="repackfit", tpot_factor=5.0)
    core = PlannerCore([policy])
    light = lambda now, ts: view(now, decoding(worker("cpu-0", {"a0": 3}), 10.0, ts=ts),  # noqa: E731
                                 decoding(worker("cpu-1", {"b0": 3}), 10.0, ts=ts))
    assert migrations(core.step(light(0.0, 0.0))) == []  # one sample: no steady step yet
    assert "the SLO's base not measured yet" in policy.skipped["b0"]
    assert migrations(core.step(light(1.0, 0.0))) == []  # the same stats again: still no sample
    effects = core.step(light(2.0, 1.0))  # a second sample, same running: best step 0.1 s, SLO 0.5 s
    assert policy.gate is not None and policy.gate.best_step == {"m": pytest.approx(0.1)}
    (move,) = migrations(effects)
    assert move.request_id in ("a0", "b0")


def test_a_sample_spent_prefilling_is_not_the_slos_base() -> None:
    # the default cluster's first samples: one request prefilling a long prompt emits ~no token, so running x u
    # reads a step of seconds; a 5x SLO on it would let every consolidation through
    policy = MellPolicy(packer="repackfit", tpot_factor=5.0)
    core = PlannerCore([policy])

    def sample(now: float, ts: float, tps: float, queued: int) -> ClusterView:
        w0 = decoding(worker("cpu-0", {"a0": 3}), tps, ts=ts)
        w0 = replace(w0, instances=(replace(w0.instances[0], queued_prompt_tokens=queued),))
        return view(now, w0, decoding(worker("cpu-1", {"b0": 3}), 0.0, ts=ts))  # cpu-1: nothing measured

    core.step(sample(0.0, 0.0, 0.02, 900))
    assert migrations(core.step(sample(1.0, 1.0, 0.02, 500))) == []  # prefilling in both: no base
    assert policy.gate is not None and "m" not in policy.gate.best_step
    core.step(sample(2.0, 2.0, 10.0, 0))  # the prefill ended during this interval: not steady yet
    assert "m" not in policy.gate.best_step
    core.step(sample(3.0, 3.0, 10.0, 0))  # decoding in both samples: the base is the decode step
    assert policy.gate.best_step == {"m": pytest.approx(0.1)}


def test_consolidation_waits_and_kv_pressure_goes_while_no_decode_is_measured() -> None:
    policy = MellPolicy(packer="repackfit", tpot_s=0.2)
    assert migrations(PlannerCore([policy]).step(split(tps=(0.0, 0.0)))) == []
    assert all("no decode measured" in why for why in policy.skipped.values())
    hot = view(0.0, worker("w0", {f"r{i}": 19 for i in range(5)}), worker("w1", {"x": 10}))
    effects = PlannerCore([MellPolicy(packer="repackfit", tpot_s=0.2)]).step(hot)
    assert migrations(effects) and all(e.trigger == "kv_pressure" for e in effects if isinstance(e.actions[0], Migrate))


def test_kv_pressure_goes_only_where_there_is_compute_room() -> None:
    hot = lambda tps1: view(0.0, decoding(worker("w0", {f"r{i}": 19 for i in range(5)}), 50.0),  # noqa: E731
                            decoding(worker("w1", {"x": 10}), tps1))
    def away(effects: list) -> list:
        return [e for e in effects if isinstance(e.actions[0], Migrate) and e.actions[0].source == "w0"]
    room = away(PlannerCore([MellPolicy(packer="repackfit", tpot_s=0.2)]).step(hot(100.0)))  # w1: 0.01 s/token
    assert room and all(e.trigger == "kv_pressure" for e in room)
    busy = MellPolicy(packer="repackfit", tpot_s=0.2)
    assert away(PlannerCore([busy]).step(hot(5.0))) == []  # w1: 0.2 s a token, 0.4 s with one more
    assert busy.skips["kv_pressure"] >= 1 and any("stays on w0" in why for why in busy.skipped.values())


def test_the_live_planner_holds_mell_to_the_configs_tpot_slo() -> None:
    def gate_of(cfg: ClusterConfig) -> TpotSlo:
        (policy,) = [p for p in build_policies(cfg, group_prefix="t") if isinstance(p, MellPolicy)]
        assert policy.gate is not None
        return policy.gate.slo
    assert gate_of(ClusterConfig()) == TpotSlo(factor=5.0)  # the default "5x"
    assert gate_of(parse_config('[slo]\ntpot = "250ms"\n')) == TpotSlo(tpot_s=0.25)
    with pytest.raises(ValueError, match="exactly one"):
        MellPolicy(tpot_s=0.2, tpot_factor=5.0)


@st.composite
def clusters(draw: st.DrawFn) -> ClusterView:
    workers = []
    for w in range(draw(st.integers(2, 4))):
        sizes = draw(st.lists(st.integers(1, 30), max_size=8))
        tps = draw(st.sampled_from([0.0, 2.0, 10.0, 40.0, 150.0]))
        base = worker(f"w{w}", {f"w{w}r{i}": s for i, s in enumerate(sizes)})
        workers.append(decoding(base, tps, waiting=draw(st.integers(0, 3))))
    return view(0.0, *workers)


@settings(max_examples=150, deadline=None)
@given(v=clusters(), slo=st.sampled_from([0.02, 0.1, 0.3, 1.0]), packer=st.sampled_from(["repackfit", "mell"]))
def test_no_consolidation_move_lands_where_the_projected_step_passes_the_slo(v: ClusterView, slo: float,
                                                                            packer: str) -> None:
    """Invariant: after an interval's moves, each destination of a consolidation move, with everything it runs,
    queues and receives, decodes within the SLO at its measured seconds per token (the model's slowest
    where it measured none); with nothing measured anywhere, no consolidation move at all."""
    effects = PlannerCore([MellPolicy(packer=packer, tpot_s=slo)]).step(v)  # type: ignore[arg-type]
    moves = [e.actions[0] for e in effects if isinstance(e.actions[0], Migrate)]
    measured = {w.worker_id: 1 / w.instances[0].tokens_per_s for w in v.workers.values()
                if w.instances[0].tokens_per_s > 0 and w.instances[0].running > 0}
    for e in effects:
        if e.trigger != "fragmentation":
            continue
        dest = e.actions[0].destination
        assert measured, "a consolidation move with no decode measured"
        u = measured.get(dest, max(measured.values()))
        inst = v.workers[dest].instances[0]
        landing = sum(1 for m in moves if m.destination == dest)
        assert (inst.running + inst.waiting + landing) * u <= slo * (1 + 1e-9), e.reason
