"""What `tidal status` prints, as rich renderables built from the report alone (no I/O, no clock).

The services; each worker's pool by kind on one line and the planner's latest purchases
(status_economy.py); then per worker: its pool as one stacked bar by kind (weights, prewarm,
adapter, KV used, KV cached, KV free, workspace, free) with a legend, its instances (batch, queue, KV use,
tokens/s) and its resident adapters. Everything fits an 80-column terminal. Only fields of today's
`WorkerStats` are read, so a newer worker that publishes more still renders.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from rich.columns import Columns
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from shared.events.worker import WorkerStats
from shared.url_credentials import redact
from tidal.commands.status_economy import MemoryTable, purchases_view
from tidal.commands.status_text import age, dash_wrap, human_bytes

if TYPE_CHECKING:
    from tidal.commands.status import StatusReport, WorkerRow

# (label, style) in bar order; the order groups what the memory economy can reclaim.
KINDS: tuple[tuple[str, str], ...] = (
    ("weights", "blue"), ("prewarm", "cyan"), ("adapter", "magenta"), ("kv used", "red"),
    ("kv cached", "bright_yellow"), ("kv free", "yellow"), ("workspace", "green"), ("free", "bright_black"),
)
STYLE = dict(KINDS)
BAR = "█"
COLOUR = {"ok": "green", "alive": "green", "ready": "green", "draining": "yellow", "starting": "yellow",
          "unreachable": "red", "dead": "red"}


def pool_segments(stats: WorkerStats) -> list[tuple[str, int]]:
    """The pool by kind, in KINDS order; KV split into used, cached (free blocks holding a cached
    prefix: evicted on demand, LRU first) and free by the instances' block use."""
    pool = stats.pool
    kv_used = sum(i.kv_blocks_used * i.kv_block_bytes for i in stats.instances)
    kv_used = min(kv_used, pool.kv_bytes)
    kv_cached = sum(getattr(i, "prefix_cached_free_bytes", 0) for i in stats.instances)  # automatic prefix caching
    kv_cached = min(kv_cached, pool.kv_bytes - kv_used)
    sizes = {"weights": pool.weights_bytes, "prewarm": pool.prewarm_bytes, "adapter": pool.adapter_bytes,
             "kv used": kv_used, "kv cached": kv_cached, "kv free": pool.kv_bytes - kv_used - kv_cached,
             "workspace": pool.workspace_bytes,
             "free": pool.free_bytes}
    return [(label, sizes[label]) for label, _style in KINDS]


def bar_cells(segments: list[tuple[str, int]], width: int) -> list[tuple[str, int]]:
    """Cells per segment, proportional to bytes (largest remainder), summing to `width` (0 if all empty)."""
    total = sum(n for _label, n in segments)
    if total <= 0 or width <= 0:
        return [(label, 0) for label, _n in segments]
    exact = [n * width / total for _label, n in segments]
    cells = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in by_remainder[: width - sum(cells)]:
        cells[i] += 1
    return [(label, c) for (label, _n), c in zip(segments, cells)]


def pool_bar_text(stats: WorkerStats, width: int) -> Text:
    bar = Text()
    for label, cells in bar_cells(pool_segments(stats), width):
        if cells:
            bar.append(BAR * cells, style=STYLE[label])
    return bar


class PoolBar:
    """The stacked bar, as wide as the space it is given."""

    def __init__(self, stats: WorkerStats) -> None:
        self.stats = stats

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield pool_bar_text(self.stats, options.max_width)


def legend(stats: WorkerStats) -> Columns:
    """One entry per kind; entries never break across lines."""
    entries = []
    for label, nbytes in pool_segments(stats):
        entry = Text("■ ", style=STYLE[label])
        entry.append(f"{label} {human_bytes(nbytes)}", style="default")
        entries.append(entry)
    return Columns(entries, padding=(0, 2))


def _plain_table() -> Table:
    return Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 1))


# numbers' columns of the instances table: (header, width); every header names its unit
INSTANCE_NUMBERS = (("running", 7), ("queued", 6), ("KV blocks", 13), ("tok/s", 7))


class InstancesTable:
    """Per instance: batch, queue, KV blocks, tokens/s over the status window; ids wrap only at dashes."""

    def __init__(self, stats: WorkerStats, rates: dict[str, float]) -> None:
        self.stats, self.rates = stats, rates

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # padding (0, 1) without edges: two cells between neighbouring columns
        names = options.max_width - sum(w for _h, w in INSTANCE_NUMBERS) - 2 * (len(INSTANCE_NUMBERS) + 1)
        inst_w = max(8, names * 11 // 20)
        model_w = max(6, names - inst_w)
        table = _plain_table()
        table.add_column("instance", width=inst_w)
        table.add_column("model", width=model_w)
        for header, width in INSTANCE_NUMBERS:
            table.add_column(header, justify="right", width=width, no_wrap=True)
        for inst in self.stats.instances:
            share = f" {100 * inst.kv_blocks_used / inst.kv_blocks_total:.0f}%" if inst.kv_blocks_total else ""
            rate = self.rates.get(inst.instance_id, inst.tokens_per_s)
            table.add_row(dash_wrap(inst.instance_id, inst_w), dash_wrap(inst.model, model_w), str(inst.running),
                          str(inst.waiting), f"{inst.kv_blocks_used}/{inst.kv_blocks_total}{share}", f"{rate:.1f}")
        yield table
        for inst in self.stats.instances:
            if inst.adapters:
                yield Text(f"adapters of {inst.instance_id}: " + ", ".join(inst.adapters))
            cold = getattr(inst, "lora_cold", None)
            if cold is not None:  # CaraServe's cold start (issue 31): what the rule chose per cold request
                yield Text(cold_line(inst.instance_id, cold))
            if inst.group_id:  # a buddy-group member (KunServe): the layers whose weights it kept
                yield Text(f"{inst.instance_id} in buddy group {inst.group_id}: "
                           f"holds layers {inst.layers.start}-{inst.layers.end - 1}")


def cold_line(instance_id: str, cold) -> str:
    """An instance's cold LoRA starts: the rule's choices (counts), mid-step takeovers, the latest decision."""
    line = (f"cold LoRA starts of {instance_id}: cpu_assist {cold.cpu_assist}, async {cold.async_load}, "
            f"inline {cold.inline}; device took over mid-step {cold.mid_step_takeovers}")
    if cold.recent:
        last = cold.recent[-1]
        line += f"; last: {last.request_id} {last.choice} ({last.reason})"
    return line


def worker_panel(row: "WorkerRow") -> Panel:
    c = COLOUR.get(row.liveness, "white")
    heartbeat = f"heartbeat {age(row.last_heartbeat_age_s)} ago" if row.last_heartbeat_age_s is not None else ""
    state = f" {row.state}" if row.state != row.liveness else ""
    life = f" [cyan]{row.lifecycle}[/cyan]" if row.lifecycle else ""  # WarmServe's worker lifecycle
    title = f"[bold]{row.worker_id}[/bold] {row.device} [{c}]{row.liveness}[/{c}]{state}{life} {heartbeat}"
    stats = row.stats
    if stats is None:
        why = "dead" if row.liveness == "dead" else "no stats received"
        body: Any = Text(f"capacity {human_bytes(row.memory_capacity_bytes)}; {why}")
    else:
        parts: list[Any] = [
            Text(f"pool {human_bytes(stats.pool.capacity_bytes)}, stats {age(row.stats_age_s)} old"),
            PoolBar(stats), legend(stats),
        ]
        if stats.instances:
            parts.append(InstancesTable(stats, row.tokens_per_s))
        parts.append(Text("resident adapters: " + (", ".join(stats.resident_adapters) or "none")))
        body = Group(*parts)
    return Panel(body, title=title, title_align="left")


# the services table's fixed columns: (header, width); the instance id takes the rest
SERVICE_COLUMNS = (("pid", 7), ("health", 11), ("registry", 8), ("uptime", 6), ("metrics", 7))


class ServicesTable:
    def __init__(self, report: "StatusReport") -> None:
        self.report = report

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        inst_w = max(8, options.max_width - sum(w for _h, w in SERVICE_COLUMNS) - 2 * len(SERVICE_COLUMNS))
        table = _plain_table()
        table.add_column("instance (service)", width=inst_w)
        for header, width in SERVICE_COLUMNS:
            table.add_column(header, width=width, no_wrap=True)
        for row in self.report.services:
            c = COLOUR.get(row.health, "white")
            name = row.instance if row.instance.startswith(row.service) else f"{row.instance} ({row.service})"
            table.add_row(dash_wrap(name, inst_w), str(row.pid or "-"), f"[{c}]{row.health}[/{c}]",
                          row.registry_state or "-", age(row.uptime_s),
                          f":{row.metrics_port}" if row.metrics_port else "-")
        yield Text("services", style="italic")
        yield table


def status_view(report: "StatusReport") -> Group:
    """The whole report: NATS line, services table, memory by kind, purchases, one panel per worker."""
    head = Text(f"NATS {redact(report.nats_url)}")
    if report.error:
        head.append(f"  {report.error}", style="red")
    return Group(head, ServicesTable(report), MemoryTable(report.workers), *purchases_view(report),
                 Text("workers", style="italic"), *(worker_panel(w) for w in report.workers))


def render_to_string(report: "StatusReport", width: int = 80) -> str:
    """The report as plain text `width` columns wide (what a test or a log file gets)."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(status_view(report))
    return out.getvalue()
