"""`tidal repro warmserve --live`: per-request timelines of one run, from the cluster's bus (read-only).

What the HTTP client cannot see: which worker served each request (its first token chunk's `worker_id`),
and the plan's actions on the way (ScaleUp with the target's warm bytes and load when it was decided,
PlacePrewarm, ScaleDown, each decided / applied / failed). `timeline(...)` sets each request beside the
actions on its model and on its worker between its arrival and its first token: where a slow request's
TTFT went (a start it waited for, onto what kind of worker; a prewarm read on the worker that served it).
Times are seconds on the run's clock (the load runner's t0, in Unix time `t0_unix`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen.runner.bus_watch import watch_stats_and_plans
from shared.bus import Bus, Delivery
from shared.events import WorkerStats
from shared.events.plan import PlacePrewarm, PlanApplied, PlanDecided, PlanEvent, PlanFailed, ScaleDown, ScaleUp
from shared.planner.view import prewarmed_models
from shared.subjects import CATALOG


@dataclass
class Action:
    kind: str  # "scale_up", "prewarm", "scale_down"
    model: str
    worker: str
    decided_unix: float
    reason: str = ""
    warm_bytes: int = 0  # scale_up: the target's warm bytes of the model in its latest stats
    load: int = 0  # scale_up / prewarm: requests running + waiting on the worker's instances then
    serving: list[str] = field(default_factory=list)  # the models the worker served then
    applied_unix: float | None = None
    failed: str = ""


class LiveWatch:
    """Subscribes to worker stats, plan events and every request's token chunks while a run goes on."""

    def __init__(self) -> None:
        self.latest: dict[str, WorkerStats] = {}
        self.actions: dict[str, Action] = {}  # plan id -> its (first) action of interest
        self.served_by: dict[str, str] = {}  # bus request id -> worker of its first chunk
        self.bus: Bus | None = None

    async def start(self, nats_url: str) -> "LiveWatch":
        self.bus = await watch_stats_and_plans(nats_url, self._on_stats, self._on_plan)
        out = CATALOG["request.out"]
        await self.bus.subscribe(out.wildcard, out.payload_type, self._on_chunk, label="request.out")
        return self

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
            self.bus = None

    async def _on_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        self.latest[msg.worker_id] = msg

    async def _on_chunk(self, msg: Any, _ctx: Delivery) -> None:
        worker = getattr(msg, "worker_id", None)
        if worker and msg.request_id not in self.served_by:
            self.served_by[msg.request_id] = worker

    async def _on_plan(self, msg: PlanEvent, _ctx: Delivery) -> None:
        if isinstance(msg, PlanDecided):
            action = msg.plan.actions[0] if msg.plan.actions else None
            kind = {ScaleUp: "scale_up", PlacePrewarm: "prewarm", ScaleDown: "scale_down"}.get(type(action))
            if kind is None or action is None:
                return
            worker = action.worker_id
            stats = self.latest.get(worker)
            row = Action(kind=kind, model=getattr(action, "model", None) or "", worker=worker,
                         decided_unix=msg.plan.ts, reason=msg.plan.reason[:120])
            if stats is not None:
                row.warm_bytes = prewarmed_models(stats).get(row.model, 0)
                row.load = sum(i.running + i.waiting for i in stats.instances)
                row.serving = sorted({i.model for i in stats.instances})
            self.actions[msg.plan.plan_id] = row
        elif isinstance(msg, PlanApplied) and msg.plan_id in self.actions:
            self.actions[msg.plan_id].applied_unix = msg.ts
        elif isinstance(msg, PlanFailed) and msg.plan_id in self.actions:
            self.actions[msg.plan_id].failed = msg.refused or msg.message[:80]


@dataclass
class RequestLine:
    request_id: str
    model: str
    arrival_s: float
    ttft_s: float | None
    worker: str
    events: list[str]  # the actions on its model or its worker while it waited for its first token


def timeline(watch: LiveWatch, outcome: Any, t0_unix: float) -> tuple[list[RequestLine], list[dict[str, Any]]]:
    """Each request (arrival order) with the actions that touched it; and every action on the run's clock."""
    acts = sorted(watch.actions.values(), key=lambda a: a.decided_unix)

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0_unix, 3)

    actions = [{**asdict(a), "decided_s": rel(a.decided_unix), "applied_s": rel(a.applied_unix)} for a in acts]
    lines = []
    for res in outcome.results:
        rec = res.record
        worker = watch.served_by.get(f"{res.response_id}-0", "") if res.response_id else ""
        start = rec.arrival_s
        end = rec.first_token_s if rec.first_token_s is not None else (rec.finish_s or start)
        events = []
        for a in acts:
            t = a.decided_unix - t0_unix
            done = (a.applied_unix - t0_unix) if a.applied_unix is not None else None
            # an action overlapping the wait: decided before the first token, not done before the arrival
            if t > end or (done is not None and done < start):
                continue
            if a.model != rec.model and (not worker or a.worker != worker):
                continue
            applied = f"{done:.2f}" if done is not None else ("failed " + a.failed if a.failed else "-")
            what = (f"warm {a.warm_bytes} B, load {a.load}, serving {'/'.join(a.serving) or '-'}"
                    if a.kind in ("scale_up", "prewarm") else "")
            events.append(f"{a.kind} {a.model} on {a.worker} decided {t:.2f} applied {applied}"
                          + (f" ({what})" if what else ""))
        lines.append(RequestLine(rec.request_id, rec.model, round(start, 3), rec.ttft_s, worker, events))
    return lines, actions


def slowest(lines: list[RequestLine], n: int = 3) -> list[RequestLine]:
    timed = [line for line in lines if line.ttft_s is not None]
    return sorted(timed, key=lambda line: -(line.ttft_s or 0.0))[:n]


def describe(line: RequestLine) -> str:
    ttft = f"{line.ttft_s:.2f}" if line.ttft_s is not None else "-"
    head = f"{line.request_id} {line.model} at {line.arrival_s:.2f} s: TTFT {ttft} s on {line.worker or '?'}"
    return head + ("; " + "; ".join(line.events) if line.events else "; no start or prewarm touched it")



__all__ = ["Action", "LiveWatch", "RequestLine", "describe", "slowest", "timeline"]
