"""The memory market over time and the tail (issue 32 item 2): an offer's bytes count for the share of the
need's duration they are free (a start once it lands, an offload until the adapter's next use), and a wait
counts past each request's TTFT SLO — in full for one already past it — for waiting and starts alike."""
from __future__ import annotations

import math

import pytest

from shared.policy.memory_market import Need, Offer, buy, price_scale_out, queue_price, wait_cost


def test_an_offer_covers_the_part_of_the_need_its_bytes_are_free() -> None:
    assert Offer("migrate", "r1", 1000, 1.0).cover(10.0) == 1.0  # at once, for good
    start = Offer("scale_out", "m", 1000, 1.0, after_s=4.0)
    assert start.cover(10.0) == pytest.approx(0.6) and start.useful_bytes(10.0) == 600
    assert Offer("scale_out", "m", 1000, 1.0, after_s=12.0).cover(10.0) == 0.0  # lands after the need is over
    offload = Offer("adapter", "w1/a", 1000, 1.0, lasts_s=2.5)  # next used in 2.5 s: reloaded then
    assert offload.cover(10.0) == pytest.approx(0.25) and offload.useful_bytes(10.0) == 250
    assert Offer("adapter", "w1/a", 1000, 1.0, after_s=2.0, lasts_s=3.0).cover(10.0) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="after_s"):
        Offer("scale_out", "m", 1000, 1.0, after_s=-1.0)
    with pytest.raises(ValueError, match="lasts_s"):
        Offer("adapter", "w1/a", 1000, 1.0, lasts_s=0.0)
    with pytest.raises(ValueError, match="duration"):
        start.cover(0.0)


def test_buy_ranks_offers_by_price_per_useful_byte_over_the_needs_duration() -> None:
    # the need lasts 20 s; two offers of 1000 B at the same price: an offload of an adapter used again in 5 s
    # serves a quarter of it, a migration the whole of it
    need = Need("worker:w1", 1000, 10.0, 2, 0.0, duration_s=20.0)
    offload = Offer("adapter", "w1/a", 1000, 1.0, lasts_s=5.0)
    move = Offer("migrate", "r1", 1000, 1.0)
    p = buy(need, [offload, move])
    assert p.offers[0] is move and p.bought == (move,)
    # timeless (both for good), the adapter would win the tie by the order of SOURCES
    assert buy(need, [Offer("adapter", "w1/a", 1000, 1.0), move]).bought[0].source == "adapter"


def test_bytes_that_serve_part_of_the_need_cover_only_that_part() -> None:
    # an offload free for a quarter of the need covers a quarter of its bytes: a second offer is still bought
    need = Need("worker:w1", 1000, 10.0, 5, 0.0, duration_s=20.0)
    offload = Offer("adapter", "w1/a", 1000, 0.1, lasts_s=5.0)
    move = Offer("migrate", "r1", 800, 0.1)
    p = buy(need, [offload, move])
    assert set(p.bought) == {offload, move}
    assert buy(Need("worker:w1", 1000, 10.0, 5, 0.0), [Offer("adapter", "w1/a", 1000, 0.1)]).covered


def test_a_start_that_lands_after_the_need_is_over_is_not_bought() -> None:
    # the scope drains its bytes in the horizon (the need lasts 10 s): a 12 s start would serve none of it
    need = Need("model:m", 1000, 10.0, 3, 100.0, duration_s=10.0)
    late = Offer("scale_out", "m", 5000, price_scale_out(12.0, 3), after_s=12.0)
    assert buy(need, [late]).bought == ()
    # the same start against a need that lasts a minute (nothing drains): bought
    long_need = Need("model:m", 1000, 10.0, 3, 0.0, duration_s=60.0)
    assert buy(long_need, [late]).bought == (late,)


def test_a_wait_counts_past_each_requests_slo_and_in_full_once_past_it() -> None:
    # three waiting requests: 4 s of slack left, 1 s, and one already 2 s past its SLO
    assert wait_cost(3.0, 3, (4.0, 1.0, -2.0)) == pytest.approx(0.0 + 2.0 + 3.0)
    assert wait_cost(3.0, 3) == pytest.approx(9.0)  # no SLO known: every wait in full (the mean)
    assert wait_cost(3.0, 4, (4.0,)) == pytest.approx(0.0 + 3 * 3.0)  # those without a slack count in full
    with pytest.raises(ValueError, match="slack"):
        wait_cost(1.0, 1, (1.0, 2.0))


def test_waiting_and_a_start_count_the_same_wait_the_same() -> None:
    slack = (4.0, 1.0, -2.0)
    need = Need("worker:w1", 1000, 10.0, 3, 1000 / 3.0, slack_s=slack)  # drains its bytes in 3 s
    assert queue_price(need) == pytest.approx(wait_cost(3.0, 3, slack)) == pytest.approx(5.0)
    assert price_scale_out(3.0, 3, 0.0, slack) == pytest.approx(queue_price(need))
    # one already past its SLO makes waiting dearer than for three fresh ones with slack to spare
    fresh = Need("worker:w1", 1000, 10.0, 3, 1000 / 3.0, slack_s=(5.0, 5.0, 5.0))
    assert queue_price(fresh) == 0.0 < queue_price(Need("worker:w1", 1000, 10.0, 3, 1000 / 3.0, slack_s=(5.0, 5.0, -1.0)))


def test_a_need_checks_its_slacks_and_duration() -> None:
    assert Need("worker:w1", 1000, 10.0, 2, 0.0).lasts_s == 10.0
    assert Need("worker:w1", 1000, 10.0, 2, 0.0, duration_s=30.0).lasts_s == 30.0
    with pytest.raises(ValueError, match="slack"):
        Need("worker:w1", 1000, 10.0, 1, 0.0, slack_s=(1.0, 2.0))
    with pytest.raises(ValueError, match="slack"):
        Need("worker:w1", 1000, 10.0, 1, 0.0, slack_s=(math.nan,))
    with pytest.raises(ValueError, match="duration_s"):
        Need("worker:w1", 1000, 10.0, 1, 0.0, duration_s=-1.0)
