"""The KV-packing fleet (loadgen/sim/kv_packing_fleet.py): requests whose timing depends on where they run.
Undelayed, it is the schedule's op stream; a GPU that its requests outgrow preempts the newest, which waits
and re-prefills (TPOT); moves pay the costs (the source held until the hand-over, a stall) or re-prefill;
MELL's adaptive migration picks KV or tokens within its boundaries; failed baseline moves are put back."""
from __future__ import annotations

import numpy as np
import pytest
from repro.test_kv_packing import fragmenting_trace
from repro.test_kv_packing_moves import BPT, LINKS, PREFILL, model

from loadgen.sim.kv_packing import build_schedule
from loadgen.sim.kv_packing_fleet import Budgets, run_fleet
from loadgen.sim.kv_packing_moves import MoveModel
from shared.policy.binpack_baselines import BestFit, LoadBalance, WorstFit
from shared.policy.mell import MellScheduler
from shared.policy.movement import MovementSpec, movement_costs


def one_token_blocks(decode_step_s: float = 100.0) -> MoveModel:
    """model()'s costs with one-token blocks: the fragmenting trace's 20-token requests fill whole 16-token
    blocks otherwise (four of them need 128 tokens of blocks, more than a 100-token device)."""
    costs = movement_costs(MovementSpec(kv_link="net", host_link="pcie", disk_link=""), LINKS)
    return MoveModel(costs, BPT, 1, decode_step_s, PREFILL)


def two_growing() -> object:
    """r0 (0.5 s) and r1 (0.6 s): prompts of 30 tokens, 60 tokens out each, one per second; C = 100 tokens."""
    return build_schedule(np.array([0.5, 0.6]), np.array([30, 30]), np.array([60, 60]), capacity=100,
                          bytes_per_token=1, granule_tokens=10, epoch_s=1.0, prefill_s_per_token=0.0,
                          decode_step_s=1.0)


def test_undelayed_the_fleet_replays_the_schedules_op_stream() -> None:
    rng = np.random.default_rng(3)
    n = 150
    s = build_schedule(np.sort(rng.uniform(0, 60, n)), rng.integers(5, 60, n), rng.integers(1, 40, n),
                       capacity=10**6, bytes_per_token=10, granule_tokens=4, epoch_s=1.0, prefill_s_per_token=0.01,
                       decode_step_s=0.2)
    for policy in (WorstFit(10**6), MellScheduler(10**6)):
        r = run_fleet(s, policy, "x")
        assert r.preemptions == 0 and r.moves == 0
        assert np.array_equal(r.used_bytes, s.used_bytes[: len(r.used_bytes)])
        assert len(r.active) == len(s.epochs) and not r.ttft_delay.any() and not r.tpot_delay.any()


def test_bf_and_wf_let_the_engine_preempt_what_outgrows_a_gpu() -> None:
    """Both prompts fit one GPU at arrival; at 21 s the two need 102 tokens: the newest (r1) is preempted
    with 21 tokens generated, waits until r0 ends (at the 60 s boundary) and goes on from there: its last 39
    tokens come 38.4 s late. MELL moves r1 to a second GPU instead, and nobody waits."""
    s = two_growing()
    for policy in (BestFit(100), WorstFit(100)):
        r = run_fleet(s, policy, policy.name)
        assert r.peak_devices() == 1 and r.preemptions == 1 and r.moves == 0
        assert r.ttft_delay.tolist() == [0.0, 0.0]
        assert r.tpot_delay[0] == 0 and r.tpot_delay[1] * 59 == pytest.approx(60 - 21 - 0.6)
        assert r.active[-1] == 0 and len(r.active) == 100  # r1 ends at 98.0: it departs at the 99 s boundary
    mell = run_fleet(s, MellScheduler(100), "MELL")
    assert mell.peak_devices() == 2 and mell.preemptions == 0 and mell.moves == 1
    assert not mell.tpot_delay.any() and len(mell.active) == len(s.epochs)


def test_a_copy_holds_its_source_until_the_hand_over_and_stalls_the_request() -> None:
    s = fragmenting_trace()  # MELL consolidates four small requests once the large ones leave
    free = run_fleet(s, MellScheduler(1000), "free")
    paid = run_fleet(s, MellScheduler(1000), "paid", moves=one_token_blocks(), mode="kv")
    assert paid.kv_migrations == free.moves > 0 and paid.token_migrations == 0
    st = paid.move_costs
    assert st.copy_s > 0 and st.bytes_copied > 0 and st.stalls and all(v > 0 for v in st.delay.values())
    assert paid.tpot_delay.max() > 0  # the stall shifts the moved requests' later tokens
    # GPUs from the placement (Eq. 3) are the same; a drained source counts physically until the hand-over
    assert (paid.active == free.active).all() and paid.active_physical.sum() > free.active_physical.sum()
    tokens = run_fleet(s, MellScheduler(1000), "tokens", moves=one_token_blocks(), mode="tokens")
    assert tokens.token_migrations == free.moves and tokens.move_costs.recompute_s > 0
    assert tokens.move_costs.kv_moves == 0


def test_mells_adaptive_migration_picks_kv_or_tokens_within_its_boundaries() -> None:
    s = fragmenting_trace()
    only_tokens = run_fleet(s, MellScheduler(1000), "t", moves=one_token_blocks(), mode="auto",
                            budgets=Budgets(link_bytes_per_s=0.0, prefill_tokens_per_s=10**6))
    only_kv = run_fleet(s, MellScheduler(1000), "k", moves=one_token_blocks(), mode="auto",
                        budgets=Budgets(link_bytes_per_s=10**9, prefill_tokens_per_s=0.0))
    assert only_tokens.token_migrations > 0 and only_tokens.kv_migrations == 0
    assert only_kv.kv_migrations > 0 and only_kv.token_migrations == 0
    rng = np.random.default_rng(7)
    n = 200
    big = build_schedule(np.sort(rng.uniform(0, 80, n)), rng.integers(5, 60, n), rng.integers(1, 40, n),
                         capacity=1000, bytes_per_token=10, granule_tokens=4, epoch_s=1.0, prefill_s_per_token=0.01,
                         decode_step_s=0.2)
    both = run_fleet(big, MellScheduler(1000), "both", moves=model(decode_step_s=0.2), mode="auto",
                     budgets=Budgets(link_bytes_per_s=1600.0, prefill_tokens_per_s=30.0))
    assert both.kv_migrations > 0 and both.token_migrations > 0
    with pytest.raises(ValueError, match="needs budgets"):
        run_fleet(s, MellScheduler(1000), "x", mode="auto")


def test_random_fleets_finish_every_request_with_consistent_books() -> None:
    rng = np.random.default_rng(11)
    n = 250
    s = build_schedule(np.sort(rng.uniform(0, 90, n)), rng.integers(5, 70, n), rng.integers(1, 60, n),
                       capacity=1000, bytes_per_token=10, granule_tokens=4, epoch_s=1.0, prefill_s_per_token=0.01,
                       decode_step_s=0.2)
    runs = {
        "BF": run_fleet(s, BestFit(1000), "BF", moves=model(0.2)),
        "LB": run_fleet(s, LoadBalance(1000, migrate_out_free=30), "LB", moves=model(0.2)),
        "MELL": run_fleet(s, MellScheduler(1000), "MELL", moves=model(0.2), mode="auto",
                          budgets=Budgets(link_bytes_per_s=1600.0, prefill_tokens_per_s=50.0)),
        "MELL-uncapped": run_fleet(s, MellScheduler(1000, max_migrations_per_op=10**6, batching=False,
                                                    bundle_members=5), "U", moves=model(0.2), mode="auto",
                                   budgets=Budgets(link_bytes_per_s=1600.0, prefill_tokens_per_s=50.0), per_op=True),
    }
    for name, r in runs.items():  # the books are checked every epoch (check=True raises on a lost request)
        assert r.active[-1] == 0 and r.requests == n, name
        st = r.move_costs
        assert st.kv_ok <= st.kv_moves and r.moves == st.kv_ok + st.token_moves, name
        assert (r.ttft_delay >= 0).all() and (r.tpot_delay >= 0).all(), name
    assert runs["BF"].moves == 0 and runs["BF"].preemptions > 0
    assert runs["LB"].moves > 0 and runs["LB"].max_moves_per_round >= 1
    assert runs["MELL-uncapped"].max_moves_per_op >= 1 and runs["MELL"].max_moves_per_op == -1
    assert runs["MELL"].decided + runs["MELL"].removed_by_batching == runs["MELL"].moves_before_dedup


def test_a_failed_lb_migration_puts_the_request_back() -> None:
    """A copy that cannot finish before its request ends fails; LB's books take the request back."""
    s = build_schedule(np.array([0.1, 0.2, 0.3]), np.array([60, 30, 5]), np.array([2, 400, 3]), capacity=1000,
                       bytes_per_token=10, granule_tokens=4, epoch_s=1.0, prefill_s_per_token=0.0,
                       decode_step_s=0.05)
    lb = LoadBalance(1000, migrate_out_free=10**6)  # every GPU sheds load
    r = run_fleet(s, lb, "LB", moves=model(0.05))
    st = r.move_costs
    assert r.active[-1] == 0
    assert st.kv_ok + sum(st.failed.values()) == st.kv_moves
