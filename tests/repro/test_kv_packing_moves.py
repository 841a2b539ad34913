"""What moves cost in the KV-packing simulation (loadgen/sim/kv_packing_moves.py): Llumnix's pre-copy
over the profile's kv link, the source held until the hand-over, the stall on the moved request,
failures that leave both sides as they were, retries, and token-mode re-prefill; every policy pays them."""
from __future__ import annotations

import numpy as np
import pytest
from repro.test_kv_packing import fragmenting_trace

from loadgen.repro.mell_setup import TESTBEDS
from loadgen.sim.kv_packing import build_schedule, run_policy
from loadgen.sim.kv_packing_core import run_core
from loadgen.sim.kv_packing_moves import MoveLedger, MoveModel
from loadgen.sim.profile import LinkSpec, StepCost
from shared.policy.binpack_baselines import BestFitRestart, WorstFitRestart
from shared.policy.mell import MellScheduler
from shared.policy.movement import MovementSpec, movement_costs

BPT, BLOCK = 10, 16  # bytes per token, tokens per block
LINKS = {"net": LinkSpec(name="net", latency_s=0.0, bandwidth_bytes_per_s=1600.0),  # 10 blocks of 160 B a second
         "pcie": LinkSpec(name="pcie", latency_s=0.0, bandwidth_bytes_per_s=1e9)}
PREFILL = StepCost(overhead_s=0.01, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, prefill_per_token_s=0.001,
                   prefill_attn_s=1e-6)


def model(decode_step_s: float = 100.0) -> MoveModel:
    costs = movement_costs(MovementSpec(kv_link="net", host_link="pcie", disk_link=""), LINKS)
    return MoveModel(costs, BPT, BLOCK, decode_step_s, PREFILL)


class Books:
    """A policy's books: request -> device, and bytes per device."""

    def __init__(self, **where: tuple[str, int]) -> None:
        self.where = {r: d for r, (d, _) in where.items()}
        self.size = {r: s for r, (_, s) in where.items()}

    def used(self, device: str) -> int:
        return sum(s for r, s in self.size.items() if self.where[r] == device)

    def move(self, rid: str, device: str) -> None:
        self.where[rid] = device


def test_a_migration_holds_the_source_until_the_hand_over_and_stalls_the_request() -> None:
    m = model()
    pc = m.precopy(800)  # 80 tokens = 5 blocks: one stopped stage of 5 x 160 B at 1600 B/s
    assert pc.ok and pc.stages == 1 and pc.stall_s == pytest.approx(0.5)
    books = Books(r0=("A", 800), r1=("B", 100))
    ledger = MoveLedger(m, capacity=1000, end_s=lambda rid: 100.0)
    books.move("r0", "B")  # the policy books r0 on B at once: B holds the reservation
    ledger.move("r0", 800, "A", "B", 0.0, kv=True, used=books.used)
    assert ledger.held("A", books.used) == 800 and ledger.held("B", books.used) == 900
    assert ledger.occupancy(["B"], books.used) == (2, False)  # A is still in use: the copy holds it
    assert ledger.stats.delay == {"r0": pytest.approx(0.5)}  # the stall shows up in r0's timing
    ledger.advance(0.4)
    assert ledger.in_flight("r0")
    ledger.advance(0.5)  # handed over
    assert not ledger.in_flight("r0") and ledger.held("A", books.used) == 0
    assert ledger.occupancy(["B"], books.used) == (1, False)
    assert ledger.stats.kv_ok == 1 and ledger.stats.bytes_copied == 800 and ledger.stats.copy_s == pytest.approx(0.5)


def test_a_longer_context_pays_pre_copy_stages_while_it_keeps_decoding() -> None:
    m = model(decode_step_s=0.5)  # 2 tokens a second written during the copy
    pc = m.precopy(3200)  # 320 tokens = 20 blocks: more than the last stage's 16
    assert pc.ok and pc.stages == 2 and pc.precopy_s == pytest.approx(2.0)
    ledger = MoveLedger(m, capacity=10_000, end_s=lambda rid: 100.0)
    ledger.move("r0", 3200, "A", "B", 0.0, kv=True, used=lambda d: 3200 if d == "B" else 0)
    assert ledger.stats.delay["r0"] == pytest.approx(pc.stall_s) and pc.stall_s < pc.precopy_s
    ledger.advance(pc.precopy_s)
    assert ledger.in_flight("r0")  # still copying the last stage


def test_a_failed_move_leaves_both_sides_as_before_then_is_retried() -> None:
    books = Books(r0=("A", 800))
    ledger = MoveLedger(model(), capacity=1000, end_s=lambda rid: 0.2)  # r0 ends before the 0.5 s hand-over
    books.move("r0", "B")
    ledger.move("r0", 800, "A", "B", 0.0, kv=True, used=books.used)
    ledger.advance(0.2)
    assert ledger.stats.failed == {"request ended": 1} and ledger.stats.kv_ok == 0 and not ledger.stats.delay
    assert ledger.stranded_at("r0") == "A"
    assert ledger.held("A", books.used) == 800 and ledger.held("B", books.used) == 0  # the reservation is freed
    ledger.depart("r0")
    assert ledger.held("A", books.used) == 0 and ledger.stranded_at("r0") is None


def test_a_destination_still_holding_an_outgoing_copy_refuses_and_the_move_is_retried() -> None:
    books = Books(r0=("B", 800), r1=("A", 400))
    ledger = MoveLedger(model(), capacity=1000, end_s=lambda rid: 100.0)
    books.move("r0", "C")
    ledger.move("r0", 800, "B", "C", 0.0, kv=True, used=books.used)  # B's 800 B stay until 0.5 s
    books.move("r1", "B")  # the books see room on B; physically it is not there yet
    ledger.move("r1", 400, "A", "B", 0.0, kv=True, used=books.used)
    assert ledger.stats.failed == {"destination full": 1} and ledger.stranded_at("r1") == "A"
    assert ledger.held("A", books.used) == 400 and ledger.held("B", books.used) == 800  # as before the move
    ledger.advance(1.0)
    ledger.retry(1.0, books.where.get, books.used)
    assert ledger.stats.retries == 1 and ledger.stats.kv_ok == 2 and ledger.stranded_at("r1") is None
    ledger.advance(2.0)
    assert ledger.held("A", books.used) == 0 and ledger.held("B", books.used) == 400


def test_token_mode_costs_the_destinations_re_prefill() -> None:
    ledger = MoveLedger(model(), capacity=1000, end_s=lambda rid: 100.0)
    ledger.move("r0", 800, "A", "B", 0.0, kv=False, used=lambda d: 0)
    n = 80
    assert ledger.stats.delay["r0"] == pytest.approx(0.01 + 0.001 * n + 1e-6 * n * n)
    assert ledger.stats.token_moves == 1 and ledger.stats.kv_moves == 0 and not ledger.in_flight("r0")


def test_every_policy_pays_for_its_moves_in_the_packing_run() -> None:
    s = fragmenting_trace()  # MELL consolidates four small requests after the large ones leave
    free = run_policy(s, MellScheduler(1000), "MELL")
    paid = run_policy(s, MellScheduler(1000), "MELL", moves=model())
    assert paid.moves == free.moves > 0 and free.move_costs is None
    st = paid.move_costs
    assert st.kv_moves >= paid.moves and st.kv_ok == paid.moves and st.copy_s > 0
    assert set(st.delay) and all(v > 0 for v in st.delay.values())
    assert (paid.active >= free.active).all()  # a source counts until its copies are handed over
    core = run_core(s, moves=model())
    assert core.move_costs.kv_ok == core.moves > 0
    restart = run_policy(s, BestFitRestart(1000), "BF-r", moves=model())
    assert restart.move_costs.kv_moves == 0 and restart.move_costs.token_moves == restart.moves


def test_the_testbeds_migrate_over_mells_10_gbps_network() -> None:
    for tb in TESTBEDS.values():
        costs = tb.profile().movement_costs()
        assert costs.kv.bandwidth_bytes_per_s == 1.25e9  # MELL §VIII-B: inter-machine 10 Gbps


def test_a_second_move_while_a_failing_copy_runs_starts_from_the_source_when_it_fails() -> None:
    books = Books(r0=("A", 800))
    ledger = MoveLedger(model(), capacity=1000, end_s=lambda rid: 0.2)
    books.move("r0", "B")
    ledger.move("r0", 800, "A", "B", 0.0, kv=True, used=books.used)  # fails at 0.2: r0 ends first
    books.move("r0", "C")
    ledger.move("r0", 800, "B", "C", 0.0, kv=True, used=books.used)  # physically from A, once the copy failed
    assert ledger.stats.failed == {"request ended": 2} and ledger.held("A", books.used) == 800
    ledger.advance(1.0)
    assert ledger.stranded_at("r0") == "A" and ledger.held("C", books.used) == 0


def test_random_packing_runs_on_a_slow_link_keep_the_books_and_the_ledger_consistent() -> None:
    rng = np.random.default_rng(5)
    n = 120
    s = build_schedule(np.sort(rng.uniform(0, 60, n)), rng.integers(5, 60, n), rng.integers(1, 40, n),
                       capacity=1000, bytes_per_token=BPT, granule_tokens=4, epoch_s=1.0, prefill_s_per_token=0.01,
                       decode_step_s=0.2)
    # (BF, WF and LB leave an overflowing GPU to its engine, which the op stream cannot play: they run in the
    # fleet, tests/repro/test_kv_packing_fleet.py)
    for policy in (MellScheduler(1000), WorstFitRestart(1000)):
        r = run_policy(s, policy, policy.__class__.__name__, moves=model(decode_step_s=0.2))
        assert r.overcommitted_epochs == 0 and r.active[-1] == 0
        st = r.move_costs
        assert st.kv_ok + sum(st.failed.values()) == st.kv_moves
    core = run_core(s, moves=model(decode_step_s=0.2))
    st = core.move_costs
    assert core.active[-1] == 0 and st.kv_ok + sum(st.failed.values()) == st.kv_moves
