"""`tidal status`'s memory economy from hand-built messages: one line per worker's pool by kind, and
the planner's purchases (what was bought, at what price, and the cheapest offer passed over)."""
from __future__ import annotations

import msgspec

from shared.events import PoolBreakdown
from shared.events.plan import PlanPurchased, PurchaseLogReply, SourcePrice
from tidal.commands.status import StatusReport
from tidal.commands.status_economy import BOUGHT_SHOWN, cheapest_not_bought, request_s, share, short_bytes
from tidal.commands.status_view import render_to_string
from test_status_view import MiB, report, stats

GiB = 1 << 30


def purchase(ts: float = 988.0, **fields) -> PlanPurchased:
    prices = [
        SourcePrice(source="prewarm", target="w0/demo-qwen", bytes=256 * MiB, price_request_s=0.0, bought=True,
                    plan_ids=["eff-1"]),
        SourcePrice(source="adapter", target="w0/sql-lora", bytes=128 * MiB, price_request_s=0.4, bought=True),
        # cheapest in absolute terms, dearest per byte: not the one to show
        SourcePrice(source="migrate", target="req-17", bytes=1 * MiB, price_request_s=0.5),
        SourcePrice(source="layers", target="w0+w1", bytes=512 * MiB, price_request_s=6.4),  # 0.0125 per MiB
        SourcePrice(source="scale_out", target="demo-llama", bytes=2 * GiB, price_request_s=40.0),  # 0.0195 per MiB
    ]
    base = dict(purchase_id="pur-1", ts=ts, scope="worker:w0", need_bytes=512 * MiB, horizon_s=30.0, waiting=4,
                reserve_request_s_per_byte=1e-8, prices=prices, bought_bytes=384 * MiB, price_request_s=1.74,
                reason="KV pressure")
    return PlanPurchased(**{**base, **fields})


def with_purchases(log: PurchaseLogReply | None) -> StatusReport:
    r = report(stats("w0"), stats("w1", prewarm_bytes=0), dead=("w2",))
    r.ts, r.purchases = 1000.0, log
    return r


def line_of(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_sizes_and_shares_are_short():
    assert [short_bytes(n) for n in (0, 512, 2048, 9 * MiB + MiB // 2, 40 * MiB, 1023 * MiB, 5 * GiB // 4)] == \
        ["0B", "512B", "2.0K", "9.5M", "40M", "1023M", "1.2G"]
    assert max(len(short_bytes(n)) for n in range(0, 1 << 44, (1 << 44) // 997)) <= 5
    assert (share(0, 100), share(1, 1000), share(31, 100), share(100, 100), share(5, 0)) == \
        ("0%", "<1%", "31%", "100%", "-")
    assert (request_s(0.0), request_s(0.0003), request_s(1.2), request_s(340.4)) == ("0", "3.0e-04", "1.20", "340")


def test_each_worker_is_one_line_with_every_kind_in_bytes_and_percent():
    text = render_to_string(with_purchases(None), width=80)
    header = line_of(text, "worker ")
    assert header.split() == ["worker", "pool", "weights", "prewarm", "adapter", "kv", "workspace", "free"]
    # 128 MiB: weights 40 (31%), prewarm 10 (8%), adapter 2 (2%), kv 32 (25%), workspace 4 (3%), free 40 (31%)
    assert line_of(text, "w0 ").split() == ["w0", "128M", "40M", "31%", "10M", "8%", "2.0M", "2%", "32M", "25%",
                                            "4.0M", "3%", "40M", "31%"]
    assert line_of(text, "w1 ").split()[4:6] == ["0B", "0%"] and line_of(text, "w1 ").split()[-2:] == ["50M", "39%"]
    assert line_of(text, "w2 ").split() == ["w2", "64M", "dead", "-", "-", "-", "-", "-"]
    # the columns line up under their headers (right-aligned)
    assert line_of(text, "w0 ").index("25%") + 3 == header.index("kv") + 2


def test_the_memory_table_fits_80_columns_with_long_ids_and_the_widest_cells():
    kinds = ("weights_bytes", "prewarm_bytes", "adapter_bytes", "kv_bytes", "workspace_bytes", "free_bytes")
    wide = PoolBreakdown(capacity_bytes=6 * 1023 * MiB, **{k: 1023 * MiB for k in kinds})
    s = msgspec.structs.replace(stats("gpu-worker-w0-a-very-long-worker-name-on-a-big-host"), pool=wide)
    text = render_to_string(report(s), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert text.count("1023M 17%") == 6
    for width in (60, 100):
        assert max(len(line) for line in render_to_string(report(s), width=width).splitlines()) <= width


def test_purchases_show_age_scope_need_what_was_bought_and_the_cheapest_offer_not_bought():
    log = PurchaseLogReply(planner_id="planner-a1", economy="arbiter",
                           purchases=[purchase(), purchase(ts=700.0, scope="model:demo-llama", reason="")])
    text = render_to_string(with_purchases(log), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "purchases by planner-a1 (newest first; prices in request-seconds)" in text
    assert "12.0s ago  worker:w0  need 512M, bought 384M, 128M waits; price 1.74  (KV" in text  # the reason wraps
    assert "5m ago  model:demo-llama  need 512M, bought 384M, 128M waits; price 1.74\n" in text
    assert line_of(text, "    bought     prewarm").split() == ["bought", "prewarm", "w0/demo-qwen", "256M", "0"]
    assert line_of(text, "    bought     adapter").split() == ["bought", "adapter", "w0/sql-lora", "128M", "0.40"]
    not_bought = [line.split() for line in text.splitlines() if "not bought" in line]
    assert not_bought == [["not", "bought", "layers", "w0+w1", "512M", "6.40"]] * 2  # per byte, not the smallest price
    assert text.index("worker:w0") < text.index("model:demo-llama") < text.index("workers\n")


def test_cheapest_not_bought_is_by_price_per_byte_and_skips_empty_offers():
    p = purchase()
    assert cheapest_not_bought(p).source == "layers"
    free_nothing = SourcePrice(source="queue", target="w0", bytes=0, price_request_s=0.0)
    only_bought = msgspec.structs.replace(p, prices=[*(x for x in p.prices if x.bought), free_nothing])
    assert cheapest_not_bought(only_bought) is None
    text = render_to_string(with_purchases(PurchaseLogReply(planner_id="p", economy="arbiter",
                                                            purchases=[only_bought])), width=80)
    assert "not bought" not in text and "bought     adapter" in text


def test_many_bought_offers_are_summed_after_the_first_few():
    offers = [SourcePrice(source="migrate", target=f"req-{i}", bytes=64 * MiB, price_request_s=0.25, bought=True)
              for i in range(BOUGHT_SHOWN + 3)]
    log = PurchaseLogReply(planner_id="p", economy="arbiter", purchases=[purchase(prices=offers)])
    text = render_to_string(with_purchases(log), width=80)
    assert sum(line.lstrip().startswith("bought") for line in text.splitlines()) == BOUGHT_SHOWN
    assert "    ... and 3 more bought, 192M for 0.75" in text


def test_no_workers_no_memory_table():
    text = render_to_string(StatusReport(nats_url="nats://x", registry_reachable=False, error="registry unreachable"))
    assert "memory by kind" not in text and "purchases: no planner answered" in text


def test_no_purchases_is_one_line_saying_why():
    for log, said in ((None, "purchases: no planner answered"),
                      (PurchaseLogReply(planner_id="p", economy="fixed-order"),
                       "purchases: none (planner economy = fixed-order)"),
                      (PurchaseLogReply(planner_id="p", economy="arbiter"),
                       "purchases: none yet (planner economy = arbiter)")):
        text = render_to_string(with_purchases(log), width=80)
        assert said in text.splitlines()
        assert sum("purchases" in line for line in text.splitlines()) == 1


def test_json_report_carries_the_purchases_typed():
    log = PurchaseLogReply(planner_id="planner-a1", economy="arbiter", purchases=[purchase()])
    wire = msgspec.json.encode(with_purchases(log))
    back = msgspec.json.decode(wire, type=StatusReport)
    assert back.purchases == log and back.ts == 1000.0
    assert msgspec.json.decode(wire)["purchases"]["purchases"][0]["prices"][0]["source"] == "prewarm"
    assert msgspec.json.decode(msgspec.json.encode(with_purchases(None)))["purchases"] is None
