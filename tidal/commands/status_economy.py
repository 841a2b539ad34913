"""`tidal status`'s memory economy, built from the report alone (no I/O, no clock).

Two parts: each worker's device pool by kind on one line (bytes and % of its pool), and the
latest purchases of the planner holding the lease (`PurchaseLogReply`): per purchase its age,
scope and need, what it bought (source, target, bytes, price in request-seconds, and how its effect
ended once it has: applied, refused with the worker's code, failed) and the cheapest offer it did not
buy, which is what the next byte would have cost; above them, the outcomes of everything bought since
the planner started (`outcomes: applied=NN% (...)`, refusals by reason).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from shared.events.plan import PlanPurchased, PurchaseLogReply, SourcePrice
from shared.events.worker import PoolBreakdown
from shared.planner.purchase_outcomes import summary
from tidal.commands.status_text import age, dash_wrap

if TYPE_CHECKING:
    from tidal.commands.status import StatusReport, WorkerRow

# (kind as in tidal_worker_pool_bytes{kind}, PoolBreakdown field, style); the kinds and free sum to capacity
POOL_KINDS: tuple[tuple[str, str, str], ...] = (
    ("weights", "weights_bytes", "blue"), ("prewarm", "prewarm_bytes", "cyan"),
    ("adapter", "adapter_bytes", "magenta"), ("kv", "kv_bytes", "red"),
    ("workspace", "workspace_bytes", "green"), ("free", "free_bytes", "bright_black"),
)
MIN_WORKER_WIDTH = 8
BOUGHT_SHOWN = 4  # per purchase; the rest are summed on one line


def short_bytes(n: int) -> str:
    """Binary units in at most 5 characters: 0B, 512K, 9.5M, 40M, 1023M, 1.2G."""
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f}{unit}" if v < 9.95 else f"{v:.0f}{unit}"
    return f"{n}B"


def share(n: int, capacity: int) -> str:
    if capacity <= 0:
        return "-"
    pct = 100 * n / capacity
    return "<1%" if 0 < pct < 0.5 else f"{pct:.0f}%"


def pool_cells(pool: PoolBreakdown) -> list[str]:
    """One cell per kind in POOL_KINDS order: bytes and share of capacity ("40M 31%")."""
    return [f"{short_bytes(getattr(pool, field))} {share(getattr(pool, field), pool.capacity_bytes)}"
            for _kind, field, _style in POOL_KINDS]


def request_s(price: float) -> str:
    """A price in request-seconds, compactly: 0, 3.0e-04, 1.20, 340."""
    if price == 0:
        return "0"
    if price < 0.01:
        return f"{price:.1e}"
    return f"{price:.2f}" if price < 100 else f"{price:.0f}"


class MemoryTable:
    """One line per worker: its pool capacity, then each kind's bytes and % of it."""

    def __init__(self, workers: "list[WorkerRow]") -> None:
        self.workers = workers

    def rows(self) -> list[tuple[str, str, list[str]]]:
        out = []
        for w in self.workers:
            if w.stats is None:
                why = "dead" if w.liveness == "dead" else "no stats"
                out.append((w.worker_id, short_bytes(w.memory_capacity_bytes), [why] + ["-"] * (len(POOL_KINDS) - 1)))
            else:
                out.append((w.worker_id, short_bytes(w.stats.pool.capacity_bytes), pool_cells(w.stats.pool)))
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = self.rows()
        if not rows:  # no worker registered (or no registry): nothing to tabulate
            return
        headers = ["pool"] + [kind for kind, _f, _s in POOL_KINDS]
        widths = [max([len(headers[0])] + [len(cap) for _w, cap, _c in rows])]
        widths += [max([len(h)] + [len(cells[i]) for _w, _cap, cells in rows]) for i, h in enumerate(headers[1:])]
        longest = max([len("worker")] + [len(worker) for worker, _cap, _c in rows])
        gap = 2  # spaces between columns; 1 where the ids would get too narrow (long ids, many digits)
        if options.max_width - sum(widths) - gap * len(widths) < min(longest, 12):
            gap = 1
        worker_w = max(MIN_WORKER_WIDTH, min(longest, options.max_width - sum(widths) - gap * len(widths)))
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 1),
                      collapse_padding=gap == 1)
        table.add_column("worker", width=worker_w)
        table.add_column("pool", justify="right", width=widths[0], no_wrap=True)
        for (kind, _field, style), width in zip(POOL_KINDS, widths[1:]):
            table.add_column(Text(kind, style=f"bold {style}"), justify="right", width=width, no_wrap=True)
        for worker, capacity, cells in rows:
            table.add_row(dash_wrap(worker, worker_w), capacity, *cells)
        yield Text("memory by kind (bytes: K/M/G = KiB/MiB/GiB; % of the worker's pool)", style="italic")
        yield table


def cheapest_not_bought(purchase: PlanPurchased) -> SourcePrice | None:
    """The offer passed over that was cheapest per byte (the market's order), if any freed bytes."""
    passed = [p for p in purchase.prices if not p.bought and p.bytes > 0]
    return min(passed, key=lambda p: p.price_request_s / p.bytes) if passed else None


def purchase_summary(purchase: PlanPurchased, age_s: float | None) -> Text:
    line = Text(f"{age(age_s)} ago  " if age_s is not None else "")
    line.append(purchase.scope, style="bold")
    line.append(f"  need {short_bytes(purchase.need_bytes)}, bought {short_bytes(purchase.bought_bytes)}")
    rest = purchase.need_bytes - purchase.bought_bytes
    if rest > 0:
        line.append(f", {short_bytes(rest)} waits", style="yellow")
    line.append(f"; price {request_s(purchase.price_request_s)}")
    if purchase.reason:
        line.append(f"  ({purchase.reason})", style="dim")
    return line


OUTCOME_WIDTH = 16


def outcome_cell(p: SourcePrice) -> Text:
    """How a bought offer's effect ended: applied, refused:<code>, failed; blank while in flight."""
    if p.outcome is None:
        return Text("")
    label = p.outcome + (f":{p.outcome_reason}" if p.outcome_reason else "")
    return Text(label[:OUTCOME_WIDTH], style={"applied": "green", "refused": "yellow"}.get(p.outcome, "red"))


class PurchaseOffers:
    """A purchase's bought offers and the cheapest one not bought, as an indented table."""

    def __init__(self, purchase: PlanPurchased) -> None:
        self.purchase = purchase

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        bought = [p for p in self.purchase.prices if p.bought]
        passed = cheapest_not_bought(self.purchase)
        rows = [("bought", p) for p in bought[:BOUGHT_SHOWN]] + ([("not bought", passed)] if passed else [])
        ended = any(p.outcome is not None for _, p in rows)
        target_w = max(MIN_WORKER_WIDTH, options.max_width - 4 - 10 - 9 - 5 - 8 - 4 - (OUTCOME_WIDTH + 1 if ended else 0))
        table = Table(box=None, pad_edge=False, show_edge=False, show_header=False, padding=(0, 1),
                      collapse_padding=True)
        table.add_column(width=3)  # the indent
        table.add_column(width=10, no_wrap=True)
        table.add_column(width=9, no_wrap=True)
        table.add_column(width=target_w)
        table.add_column(justify="right", width=5, no_wrap=True)
        table.add_column(justify="right", width=8, no_wrap=True)
        if ended:
            table.add_column(width=OUTCOME_WIDTH, no_wrap=True)
        for tag, p in rows:
            cells = ["", Text(tag, style="green" if tag == "bought" else "yellow"), p.source,
                     dash_wrap(p.target, target_w), short_bytes(p.bytes), request_s(p.price_request_s)]
            if ended:
                cells.append(outcome_cell(p))
            table.add_row(*cells)
        yield table
        if len(bought) > BOUGHT_SHOWN:
            more = bought[BOUGHT_SHOWN:]
            yield Text(f"    ... and {len(more)} more bought, {short_bytes(sum(p.bytes for p in more))} "
                       f"for {request_s(sum(p.price_request_s for p in more))}")
        if not rows:
            yield Text("    nothing was offered")


def purchases_view(report: "StatusReport") -> list[Text | PurchaseOffers]:
    """The purchases section: one line when there is nothing to show (never an error)."""
    log: PurchaseLogReply | None = report.purchases
    if log is None:
        return [Text("purchases: no planner answered", style="italic")]
    if not log.purchases:
        none = "none" if log.economy == "fixed-order" else "none yet"
        return [Text(f"purchases: {none} (planner economy = {log.economy})", style="italic")]
    out: list[Text | PurchaseOffers] = [Text(
        f"purchases by {log.planner_id} (newest first; prices in request-seconds)", style="italic")]
    ended = summary(log.outcomes)
    if ended or log.in_flight:
        out.append(Text(f"outcomes: {ended or 'none ended yet'}, {log.in_flight} in flight"))
    for purchase in log.purchases:
        age_s = max(0.0, report.ts - purchase.ts) if report.ts else None
        out += [purchase_summary(purchase, age_s), PurchaseOffers(purchase)]
    return out
