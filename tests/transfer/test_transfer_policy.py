"""The transfer scheduler's decisions (pure: no I/O, time passed in)."""
from __future__ import annotations

import pytest

from services.gpu_worker.transfer.policy import (
    ALIGN, BandwidthEstimator, ChunkingConfig, LinkSchedule, TrafficClass, chunk_bytes,
)

MiB = 1 << 20
KV, ACT, W = TrafficClass.KV, TrafficClass.ACTIVATION, TrafficClass.WEIGHTS


def fixed(chunk: int = MiB, **kw: object) -> LinkSchedule:
    """A schedule whose bulk chunk size is pinned to `chunk`."""
    return LinkSchedule(ChunkingConfig(min_chunk=chunk, max_chunk=chunk, **kw))  # type: ignore[arg-type]


def drain(s: LinkSchedule, now: float = 0.0) -> list[tuple[int, int, int]]:
    """Post and complete chunks one at a time until nothing is left: [(tid, index, length)]."""
    out = []
    while (plan := s.next_chunk(now)) is not None:
        out.append((plan.tid, plan.index, plan.length))
        now += 0.001
        s.chunk_done(plan.length, now, express=plan.express)
        if plan.last:
            s.transfer_ended(plan.tid)  # acknowledged
    return out


def test_chunk_size_follows_bandwidth_and_target_delay() -> None:
    cfg = ChunkingConfig(target_delay_s=0.002, max_in_flight=2, min_chunk=64 << 10, max_chunk=64 * MiB)
    # 1 GB/s x 2 ms / 2 in flight = 1 MB, rounded down to a page
    assert chunk_bytes(1e9, cfg) == 1_000_000 - 1_000_000 % ALIGN
    assert chunk_bytes(10e9, cfg) == 10_000_000 - 10_000_000 % ALIGN
    assert chunk_bytes(1e3, cfg) == 64 << 10  # clamped up
    assert chunk_bytes(1e13, cfg) == 64 * MiB  # clamped down


def test_chunks_are_long_enough_to_amortise_the_fixed_cost_per_chunk() -> None:
    cfg = ChunkingConfig(target_delay_s=0.002, max_in_flight=1, min_efficiency=0.9, min_chunk=ALIGN, max_chunk=1 << 30)
    # 1 GB/s, 0.5 ms fixed per chunk: 90% efficiency needs 4.5 ms of data per chunk
    assert chunk_bytes(1e9, cfg, overhead_s=0.0005) == 4_500_000 - 4_500_000 % ALIGN
    assert chunk_bytes(1e9, cfg, overhead_s=0.00001) == 2_000_000 - 2_000_000 % ALIGN  # RDMA-like: the target decides


def test_fixed_cost_per_chunk_is_the_intercept_of_time_vs_size() -> None:
    est = BandwidthEstimator(initial=1.0)
    for _ in range(4):  # 1 MiB/ms on the wire + 0.5 ms per chunk, at two sizes
        est.observe(MiB, 0.0015)
        est.observe(4 * MiB, 0.0045)
    assert est.overhead == pytest.approx(0.0005)
    for _ in range(64):  # then only one size: the intercept is undetermined, o is kept
        est.observe(2 * MiB, 0.0025)
    assert est.overhead == pytest.approx(0.0005)


def test_bandwidth_estimate_is_a_decaying_peak_over_windows_of_busy_time() -> None:
    est = BandwidthEstimator(initial=1.0, window_s=0.004, decay=0.5)
    est.observe(MiB, 0.002)
    assert est.value == 1.0 and est.samples == 0  # half a window: no sample yet
    est.observe(MiB, 0.002)
    assert est.value == pytest.approx(2 * MiB / 0.004)  # the first sample replaces the guess
    est.observe(MiB, 0.008)  # a slower window: the peak decays instead of dropping to it
    assert est.value == pytest.approx(0.5 * 2 * MiB / 0.004)
    est.observe(8 * MiB, 0.004)  # a faster window is taken at once
    assert est.value == pytest.approx(8 * MiB / 0.004)
    assert est.samples == 3


def test_link_rate_counts_busy_time_only() -> None:
    """Chunks completing in a burst, and idle gaps between transfers, do not skew the rate."""
    s = LinkSchedule(ChunkingConfig(min_chunk=MiB, max_chunk=MiB, max_in_flight=2, initial_bandwidth=1.0))
    s.add(1, KV, 2 * MiB, now=0.0)
    s.next_chunk(0.0), s.next_chunk(0.0)
    s.chunk_done(MiB, now=0.010)
    assert s.bandwidth.value == pytest.approx(MiB / 0.010)
    s.chunk_done(MiB, now=0.0100001)  # completes right behind the first: 0.1 µs is no sample on its own
    assert s.bandwidth.value == pytest.approx(MiB / 0.010)
    s = LinkSchedule(ChunkingConfig(min_chunk=MiB, max_chunk=MiB, max_in_flight=1, initial_bandwidth=1.0))
    s.bandwidth.window_s = 0.0
    s.bandwidth.decay = 0.0  # follow every sample
    s.add(1, KV, MiB, now=0.0)
    s.next_chunk(0.0)
    s.chunk_done(MiB, now=0.001)
    s.add(2, KV, MiB, now=5.0)  # five idle seconds
    s.next_chunk(5.0)
    s.chunk_done(MiB, now=5.001)
    assert s.bandwidth.value == pytest.approx(MiB / 0.001)


def test_strict_priority_between_classes() -> None:
    s = fixed(MiB)
    s.add(1, W, 2 * MiB, 0.0)
    s.add(2, KV, 2 * MiB, 0.0)
    s.add(3, ACT, 1000, 0.0)
    order = [tid for tid, _, _ in drain(s)]
    assert order == [3, 2, 2, 1, 1]


def test_activation_goes_out_at_once_on_its_own_lane_while_bulk_chunks_are_in_flight() -> None:
    s = fixed(MiB, max_in_flight=2, latency_window_s=0.0)
    s.add(1, KV, 10 * MiB, 0.0)
    bulk = [s.next_chunk(0.0), s.next_chunk(0.0)]
    assert all(p is not None and not p.express for p in bulk)
    assert s.next_chunk(0.1) is None  # the bulk lane is full
    s.add(2, ACT, 4096, now=0.5)
    act = s.next_chunk(0.5)  # ... but the express lane is not
    assert act is not None and act.tid == 2 and act.express and act.last
    assert act.waited_s == 0.0 and act.chunks_ahead == 0
    assert s.in_flight == 2 and s.express_in_flight == 1
    s.chunk_done(act.length, 0.501, express=True)
    assert s.in_flight == 2 and s.express_in_flight == 0  # its completion frees its own slot only
    s.transfer_ended(2)
    assert s.next_chunk(0.502) is None
    s.chunk_done(MiB, 0.6)
    nxt = s.next_chunk(0.6)
    assert nxt is not None and nxt.tid == 1 and not nxt.express


def test_bulk_is_held_back_while_an_activation_is_outstanding() -> None:
    s = fixed(MiB, max_in_flight=2, max_bulk_hold_s=0.05, latency_window_s=0.0)
    s.add(1, KV, 10 * MiB, 0.0)
    first = s.next_chunk(0.0)
    assert first is not None
    s.add(2, ACT, 4096, now=0.001)
    assert s.bulk_limit(0.001) == 0  # queued: the bulk lane already holds back
    act = s.next_chunk(0.001)
    assert act is not None and act.express
    assert s.next_chunk(0.002) is None  # a free bulk slot, but the activation is not answered yet
    s.chunk_done(act.length, 0.003, express=True)
    assert s.next_chunk(0.004) is None  # sent is not answered: the receiver still verifies and acks it
    assert s.hold_expires_at() == pytest.approx(0.051)
    s.transfer_ended(2)  # the Ack
    assert s.hold_expires_at() is None
    resumed = s.next_chunk(0.005)
    assert resumed is not None and resumed.tid == 1 and s.in_flight == 2


def test_a_bulk_hold_lasts_at_most_max_bulk_hold_s() -> None:
    s = fixed(MiB, max_in_flight=2, max_bulk_hold_s=0.05)
    s.add(1, KV, 10 * MiB, 0.0)
    s.add(2, ACT, 4096, now=0.0)
    assert s.next_chunk(0.0).express  # type: ignore[union-attr]
    assert s.next_chunk(0.049) is None
    late = s.next_chunk(0.05)  # never answered (a stuck peer): bulk goes on
    assert late is not None and late.tid == 1
    assert s.hold_expires_at() == pytest.approx(0.05)


def test_latency_mode_keeps_fewer_bulk_chunks_in_flight_after_an_activation() -> None:
    s = fixed(MiB, max_in_flight=2, latency_in_flight=1, latency_window_s=0.1)
    s.add(1, KV, 10 * MiB, 0.0)
    assert s.bulk_limit(0.0) == 2  # no activation seen yet: full depth
    s.add(2, ACT, 4096, now=1.0)
    act = s.next_chunk(1.0)
    assert act is not None and act.express
    s.chunk_done(act.length, 1.001, express=True)
    s.transfer_ended(2)
    assert s.bulk_limit(1.002) == 1
    assert s.next_chunk(1.002) is not None and s.next_chunk(1.002) is None  # one bulk chunk on the wire
    assert s.bulk_limit(1.1) == 2  # the window passed: full depth again
    assert s.next_chunk(1.1) is not None


def test_bulk_in_flight_under_activation_is_a_cap() -> None:
    s = fixed(MiB, max_in_flight=3, bulk_in_flight_under_activation=1, latency_window_s=0.0)
    s.add(1, KV, 10 * MiB, 0.0)
    s.add(2, ACT, 4096, now=0.0)
    plans = [s.next_chunk(0.0) for _ in range(3)]
    assert [(p.tid, p.express) for p in plans if p is not None] == [(2, True), (1, False)]
    s.transfer_ended(2)
    assert s.bulk_limit(0.0) == 3 and s.next_chunk(0.0) is not None


def test_express_lane_has_its_own_in_flight_limit() -> None:
    s = fixed(MiB, max_express_in_flight=2)
    for tid in (1, 2, 3):
        s.add(tid, ACT, 1000, 0.0)
    s.add(4, KV, MiB, 0.0)
    plans = [s.next_chunk(0.0) for _ in range(3)]
    assert [(p.tid, p.express) for p in plans if p is not None] == [(1, True), (2, True)]  # bulk held back
    s.chunk_done(1000, 0.001, express=True)
    third = s.next_chunk(0.001)
    assert third is not None and third.tid == 3 and third.express
    for tid in (1, 2, 3):
        s.transfer_ended(tid)
    bulk = s.next_chunk(0.002)
    assert bulk is not None and bulk.tid == 4 and not bulk.express


def test_express_completions_are_no_bandwidth_samples() -> None:
    """An activation's time overlaps the bulk lane's busy time: only bulk chunks measure the link."""
    s = LinkSchedule(ChunkingConfig(min_chunk=MiB, max_chunk=MiB, initial_bandwidth=123.0))
    s.bandwidth.window_s = 0.0
    s.add(1, ACT, 256 << 10, 0.0)
    act = s.next_chunk(0.0)
    assert act is not None and act.express
    s.chunk_done(act.length, 0.01, express=True)
    s.transfer_ended(1)
    assert s.bandwidth.value == 123.0 and s.bandwidth.samples == 0
    s.add(2, KV, MiB, 0.0)
    bulk = s.next_chunk(0.0)
    assert bulk is not None and not bulk.express
    s.chunk_done(MiB, 0.002)
    assert s.bandwidth.value == pytest.approx(MiB / 0.002)


def test_without_the_express_lane_an_activation_goes_out_at_the_next_chunk_boundary() -> None:
    s = fixed(MiB, max_in_flight=1, express_activations=False)
    s.add(1, KV, 10 * MiB, 0.0)
    for _ in range(3):
        plan = s.next_chunk(0.0)
        assert plan is not None and plan.tid == 1
        s.chunk_done(plan.length, 0.001)
    inflight = s.next_chunk(0.0)  # the 4th KV chunk is on the wire when the activation arrives
    s.add(2, ACT, 4096, now=0.5)
    assert s.next_chunk(0.6) is None  # one chunk in flight: the link is full
    assert inflight is not None
    s.chunk_done(inflight.length, 0.7)
    act = s.next_chunk(0.7)
    assert act is not None and act.tid == 2 and act.last
    assert act.chunks_ahead == 0 and act.waited_s == pytest.approx(0.2)  # waited for that one chunk only
    assert s.queued_bytes(KV) == 6 * MiB  # the KV transfer resumes afterwards
    assert not act.express


def test_chunks_ahead_counts_chunks_posted_while_waiting() -> None:
    s = fixed(MiB, max_in_flight=2)
    s.add(1, KV, 10 * MiB, 0.0)
    s.add(2, KV, MiB, 0.0)
    first = s.next_chunk(0.0)
    assert first is not None and first.tid == 1 and first.chunks_ahead == 0
    second = s.next_chunk(0.0)
    assert second is not None and second.tid == 2 and second.chunks_ahead == 1


def test_round_robin_within_a_class() -> None:
    s = fixed(MiB)
    s.add(1, KV, 3 * MiB, 0.0)
    s.add(2, KV, 3 * MiB, 0.0)
    s.add(3, KV, 1 * MiB, 0.0)
    assert [tid for tid, _, _ in drain(s)] == [1, 2, 3, 1, 2, 1, 2]


def test_activations_are_not_chunked_but_bulk_is() -> None:
    s = fixed(MiB)
    s.add(1, ACT, 5 * MiB, 0.0)
    s.add(2, KV, 5 * MiB, 0.0)
    chunks = drain(s)
    assert chunks[0] == (1, 0, 5 * MiB)
    assert [length for tid, _, length in chunks if tid == 2] == [MiB] * 5


def test_chunk_offsets_cover_the_transfer_exactly() -> None:
    s = fixed(MiB)
    s.add(1, KV, 3 * MiB + 7, 0.0)
    plans = []
    while (p := s.next_chunk(0.0)) is not None:
        plans.append(p)
        s.chunk_done(p.length, 0.001)
    assert [(p.offset, p.length, p.last) for p in plans] == [
        (0, MiB, False), (MiB, MiB, False), (2 * MiB, MiB, False), (3 * MiB, 7, True)]
    assert [p.index for p in plans] == [0, 1, 2, 3]


def test_empty_transfer_is_one_empty_last_chunk() -> None:
    s = fixed(MiB)
    s.add(1, KV, 0, 0.0)
    assert drain(s) == [(1, 0, 0)]
    assert not s.has_work()


def test_in_flight_limit() -> None:
    s = fixed(MiB, max_in_flight=2)
    s.add(1, KV, 8 * MiB, 0.0)
    assert s.next_chunk(0.0) is not None and s.next_chunk(0.0) is not None
    assert s.next_chunk(0.0) is None
    s.chunk_failed()
    assert s.next_chunk(0.0) is not None


def test_cancel_drops_unsent_bytes() -> None:
    s = fixed(MiB)
    s.add(1, KV, 4 * MiB, 0.0)
    s.add(2, KV, 2 * MiB, 0.0)
    plan = s.next_chunk(0.0)
    assert plan is not None and plan.tid == 1
    assert s.cancel(1)
    assert not s.cancel(1) and not s.cancel(99)
    assert s.queued_bytes(KV) == 2 * MiB and s.depth(KV) == 1
    s.chunk_done(plan.length, 0.001)
    assert {tid for tid, _, _ in drain(s)} == {2}


def test_backpressure_bound_per_class() -> None:
    s = fixed(MiB, queue_bound_bytes=4 * MiB)
    assert s.can_admit(KV, 100 * MiB)  # an empty queue always admits: a big transfer still goes
    s.add(1, KV, 3 * MiB, 0.0)
    assert not s.can_admit(KV, 2 * MiB)
    assert s.can_admit(KV, MiB)
    assert s.can_admit(ACT, 3 * MiB)  # other classes have their own bound
    drain(s)
    assert s.can_admit(KV, 4 * MiB)


def test_fifo_baseline_sends_whole_transfers_in_arrival_order() -> None:
    s = fixed(MiB, fifo=True)
    s.add(1, W, 3 * MiB, 0.0)
    s.add(2, KV, 2 * MiB, 0.0)
    s.add(3, ACT, 100, 0.0)
    assert drain(s) == [(1, 0, 3 * MiB), (2, 0, 2 * MiB), (3, 0, 100)]
    assert not s.express  # one lane: an activation waits behind whole transfers


def test_add_rejects_duplicates_and_negative_sizes() -> None:
    s = fixed(MiB)
    s.add(1, KV, 10, 0.0)
    with pytest.raises(ValueError):
        s.add(1, KV, 10, 0.0)
    with pytest.raises(ValueError):
        s.add(2, KV, -1, 0.0)
    with pytest.raises(ValueError):
        ChunkingConfig(min_chunk=2 * MiB, max_chunk=MiB)
