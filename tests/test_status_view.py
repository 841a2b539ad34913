"""`tidal status`'s rendering from constructed WorkerStats: proportional bars, labelled kinds, 80 columns."""
from __future__ import annotations

import asyncio

import msgspec
from rich.console import Console

from shared.events import InstanceStats, LayerRange, PoolBreakdown, WorkerState, WorkerStats
from tidal.commands.status import ServiceRow, StatusReport, StatusSource, WorkerRow
from tidal.commands.status_view import (
    BAR, STYLE, bar_cells, dash_wrap, pool_bar_text, pool_segments, render_to_string, status_view,
)

MiB = 1 << 20


def stats(worker: str = "w0", **pool: int) -> WorkerStats:
    sizes = {"weights_bytes": 40 * MiB, "prewarm_bytes": 10 * MiB, "adapter_bytes": 2 * MiB, "kv_bytes": 32 * MiB,
             "workspace_bytes": 4 * MiB, **pool}
    capacity = 128 * MiB
    return WorkerStats(
        worker_id=worker, seq=7, ts=1000.0, device="cpu", state=WorkerState.READY,
        pool=PoolBreakdown(capacity_bytes=capacity, free_bytes=capacity - sum(sizes.values()), **sizes),
        instances=[
            InstanceStats(instance_id=f"{worker}-demo-llama-0", model="demo-llama", layers=LayerRange(start=0, end=4),
                          running=3, waiting=5, kv_blocks_total=64, kv_blocks_used=16, kv_block_bytes=MiB // 4,
                          tokens_per_s=41.5, adapters=["sql-lora"]),
            InstanceStats(instance_id=f"{worker}-demo-qwen-0", model="demo-qwen", layers=LayerRange(start=0, end=2),
                          running=0, waiting=0, kv_blocks_total=64, kv_blocks_used=0, kv_block_bytes=MiB // 4),
        ],
        resident_adapters=["sql-lora"],
    )


def report(*workers: WorkerStats, dead: tuple[str, ...] = ()) -> StatusReport:
    rows = [WorkerRow(worker_id=s.worker_id, device="cpu", memory_capacity_bytes=s.pool.capacity_bytes, liveness="alive",
                      state="ready", last_heartbeat_age_s=0.2, stats=s, stats_age_s=0.1) for s in workers]
    rows += [WorkerRow(worker_id=w, device="cpu", memory_capacity_bytes=64 * MiB, liveness="dead", state="dead",
                       last_heartbeat_age_s=31.0) for w in dead]
    services = [ServiceRow(service="gpu_worker", instance="gpu_worker-w0-a-rather-long-instance-name", pid=4242,
                           health="ok", registry_state="ready", uptime_s=12.0, metrics_port=9410)]
    return StatusReport(nats_url="nats://127.0.0.1:4222", registry_reachable=True, services=services, workers=rows)


def test_segments_split_kv_into_used_and_free_and_sum_to_capacity():
    segs = dict(pool_segments(stats()))
    assert segs["kv used"] == 16 * MiB // 4 and segs["kv free"] == 32 * MiB - 4 * MiB
    assert segs["adapter"] == 2 * MiB and segs["prewarm"] == 10 * MiB
    assert sum(segs.values()) == 128 * MiB


def test_bar_cells_are_proportional_and_fill_the_width():
    cells = dict(bar_cells([("weights", 50), ("kv used", 25), ("free", 25)], 40))
    assert cells == {"weights": 20, "kv used": 10, "free": 10}
    odd = bar_cells([("a", 1), ("b", 1), ("c", 1)], 10)
    assert sum(c for _l, c in odd) == 10 and sorted(c for _l, c in odd) == [3, 3, 4]
    assert dict(bar_cells([("a", 0), ("b", 0)], 10)) == {"a": 0, "b": 0}


def test_pool_bar_styles_each_kind_in_proportion():
    s = stats()
    bar = pool_bar_text(s, 64)  # 128 MiB over 64 cells: 2 MiB a cell
    assert bar.plain == BAR * 64
    per_style = {}
    for span in bar.spans:
        per_style[span.style] = per_style.get(span.style, 0) + span.end - span.start
    assert per_style[STYLE["weights"]] == 20 and per_style[STYLE["prewarm"]] == 5
    assert per_style[STYLE["adapter"]] == 1 and per_style[STYLE["kv used"]] == 2 and per_style[STYLE["kv free"]] == 14
    assert per_style[STYLE["workspace"]] == 2 and per_style[STYLE["free"]] == 20


def test_report_reads_at_80_columns_with_every_kind_instance_and_adapter():
    text = render_to_string(report(stats("w0"), stats("w1", prewarm_bytes=0), dead=("w2",)), width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    for label in ("weights", "prewarm", "adapter", "kv used", "kv free", "workspace", "free"):
        assert f"{label} " in text, label
    assert "weights 40.0MiB" in text and "kv used 4.0MiB" in text and "kv free 28.0MiB" in text
    for worker in ("w0", "w1"):
        assert f"{worker}-demo-llama-0" in text and f"{worker}-demo-qwen-0" in text
    llama_row = next(line for line in lines if "w0-demo-llama-0" in line)
    assert "16/64 25%" in llama_row and "41.5" in llama_row
    assert "adapters of w0-demo-llama-0: sql-lora" in text
    assert text.count("resident adapters: sql-lora") == 2
    assert "w2" in text and "dead" in text
    assert sum(line.count(BAR) >= 60 for line in lines) == 2  # one full-width bar per live worker


def test_a_newer_worker_stats_with_extra_fields_still_renders():
    """Another engineer may add per-instance pool fields: decode ignores them, the view reads today's."""
    wire = msgspec.json.encode(stats())
    raw = msgspec.json.decode(wire)
    raw["pool"]["per_instance"] = [{"instance_id": "x", "kv_bytes": 1}]
    raw["instances"][0]["pool_bytes"] = 123
    newer = msgspec.json.decode(msgspec.json.encode(raw), type=WorkerStats)
    assert "w0-demo-llama-0" in render_to_string(report(newer), width=80)


def test_json_report_carries_the_stats():
    decoded = msgspec.json.decode(msgspec.json.encode(report(stats())))
    assert decoded["workers"][0]["stats"]["pool"]["weights_bytes"] == 40 * MiB


def test_narrow_terminal_does_not_crash():
    out = Console(width=40, color_system=None)
    with out.capture() as captured:
        out.print(status_view(report(stats())))
    assert max(len(line) for line in captured.get().splitlines()) <= 40


LONG_WORKER = "gpu-worker-w0-a-long-name"
LONG_MODEL = "smollm2-135m-instruct-with-a-suffix"


def first_cells(text: str) -> list[str]:
    """The first cell of every line (inside a panel too)."""
    cells = []
    for line in text.splitlines():
        inner = line.strip("│ ")
        cells.append(inner.split()[0] if inner.split() else "")
    return cells


def joined_at_dashes(cells: list[str], name: str) -> bool:
    """`name` is printed whole, or over consecutive lines each ending in '-' or '_' but the last."""
    for start in range(len(cells)):
        acc = ""
        for cell in cells[start:]:
            acc += cell
            if acc == name:
                return True
            if not name.startswith(acc) or not cell.endswith(("-", "_")):
                break
    return False


def test_at_80_columns_ids_wrap_only_at_dashes_and_every_column_has_its_unit():
    s = stats(LONG_WORKER)
    long_inst = msgspec.structs.replace(s.instances[0], instance_id=f"{LONG_WORKER}-{LONG_MODEL}-0", model=LONG_MODEL)
    s = msgspec.structs.replace(s, instances=[long_inst, s.instances[1]])
    r = report(s)
    r.services.append(ServiceRow(service="dispatcher", instance="dispatcher-a-rather-long-hostname-3fa2b1-r12",
                                 pid=4194303, health="unreachable", registry_state="draining", uptime_s=5000.0,
                                 metrics_port=9411))
    text = render_to_string(r, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    cells = first_cells(text)
    for name in ("gpu_worker-w0-a-rather-long-instance-name", "dispatcher-a-rather-long-hostname-3fa2b1-r12",
                 f"{LONG_WORKER}-{LONG_MODEL}-0", f"{LONG_WORKER}-demo-qwen-0"):
        assert joined_at_dashes(cells, name), f"{name} broken mid-word:\n{text}"
    assert "4194303" in text and "unreachable" in text and ":9411" in text and "83m" in text
    header = next(line for line in text.splitlines() if "tok/s" in line)
    assert all(unit in header for unit in ("running", "queued", "KV blocks", "tok/s"))


def test_dash_wrap_breaks_after_dashes_and_cuts_only_a_piece_longer_than_a_line():
    assert dash_wrap("gpu_worker-w0-3f9a1c-r1", 12).plain == "gpu_worker-\nw0-3f9a1c-r1"
    assert dash_wrap("gpu_worker-w0-3f9a1c-r1", 10).plain == "gpu_\nworker-w0-\n3f9a1c-r1"
    assert dash_wrap("short", 12).plain == "short"
    assert dash_wrap("abcdefghij-k", 4).plain == "abcd\nefgh\nij-k"


def test_tokens_per_s_is_the_mean_over_the_window_of_stats_reports():
    source = StatusSource(bus=None, nats_url="nats://x", timeout=1.0)
    base = stats("w0")
    for ts, rate in ((100.0, 80.0), (100.25, 0.0), (100.5, 40.0), (106.0, 0.0)):
        insts = [msgspec.structs.replace(base.instances[0], tokens_per_s=rate)]
        asyncio.run(source._on_stats(msgspec.structs.replace(base, ts=ts, instances=insts), None))
    assert source.rates(5.0)["w0"] == {"w0-demo-llama-0": 0.0}  # only the last report is within 5 s
    assert source.rates(10.0)["w0"] == {"w0-demo-llama-0": 30.0}  # (80 + 0 + 40 + 0) / 4


def test_a_buddy_group_member_shows_its_group_and_the_layers_it_kept():
    s = stats("w0")
    s.instances[0] = msgspec.structs.replace(s.instances[0], group_id="bg-7", layers=LayerRange(start=0, end=2))
    text = render_to_string(report(s), width=80)
    assert "w0-demo-llama-0 in buddy group bg-7: holds layers 0-1" in text
    assert text.count("buddy group") == 1  # the other instance is in none


def test_cached_prefix_blocks_are_their_own_kind_out_of_kv_free():
    s = stats()
    s.instances[1] = msgspec.structs.replace(s.instances[1], prefix_cached_free_bytes=6 * MiB)
    segs = dict(pool_segments(s))
    assert segs["kv cached"] == 6 * MiB and segs["kv free"] == 32 * MiB - 4 * MiB - 6 * MiB
    assert sum(segs.values()) == 128 * MiB
    text = render_to_string(report(s), width=80)
    assert "kv cached 6.0MiB" in text and max(len(line) for line in text.splitlines()) <= 80


def test_cold_lora_choices_are_shown_per_instance_and_survive_the_wire():
    from shared.events.worker import LoRAColdDecision, LoRAColdStarts

    s = stats()
    cold = LoRAColdStarts(cpu_assist=2, async_load=1, inline=0, mid_step_takeovers=1, recent=[
        LoRAColdDecision(request_id="req-1", choice="async", reason="T_cpu 90.0 ms >= X 3.7 ms + P 10.0 ms"),
        LoRAColdDecision(request_id="req-2", choice="cpu_assist", reason="T_cpu 12.0 ms < X 16.8 ms + P 32.0 ms")])
    s = msgspec.structs.replace(s, instances=[msgspec.structs.replace(s.instances[0], lora_cold=cold), s.instances[1]])
    wire = msgspec.json.decode(msgspec.json.encode(s), type=WorkerStats)
    assert wire.instances[0].lora_cold == cold and wire.instances[1].lora_cold is None
    assert b'"async":1' in msgspec.json.encode(cold)  # the choice's own name on the wire
    text = render_to_string(report(wire), width=80)
    flat = " ".join(text.replace("│", " ").split())  # wrapped inside the worker panel
    assert "cold LoRA starts of w0-demo-llama-0: cpu_assist 2, async 1, inline 0" in flat
    assert "mid-step 1" in flat and "last: req-2 cpu_assist (T_cpu 12.0 ms < X 16.8 ms + P 32.0 ms)" in flat
    assert "w0-demo-qwen-0: cpu" not in flat  # an instance without cold LoRA requests shows none
    assert all(len(line) <= 80 for line in text.splitlines())
