"""`tidal repro kunserve --live`, the pure half: the burst trace, per-phase figures, plan tallies,
the summary line (and parsing it back). No I/O, no clock.

The trace is calm, then a burst of `burst_factor` x the calm rate with long outputs (the KV of
the running requests outgrows every replica's memory: KunServe §2.2's case), then calm again
(long enough for the planner to restore the layers and dissolve the groups). Poisson arrivals,
seeded; one model.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadgen.report.records import RequestRecord
from loadgen.traces.schema import TraceRecord
from shared.events.plan import (
    DissolveGroup, DropInstanceLayers, FormGroup, PlanApplied, PlanCancelled, PlanDecided, PlanEvent, PlanFailed,
    RestoreInstanceLayers,
)

LINE = re.compile(r"^repro kunserve \(live\): live_p99_ttft_vs_no_groups=(\d+\.\d)x live_p50_tbt_vs_no_groups=(\d+\.\d\d)x$")
KUN_ACTIONS = {FormGroup: "form", DropInstanceLayers: "drop", RestoreInstanceLayers: "restore", DissolveGroup: "dissolve"}


@dataclass(frozen=True)
class BurstSpec:
    model: str = "kun-8l"
    calm_s: float = 8.0  # calm before the burst
    burst_s: float = 10.0
    tail_s: float = 24.0  # calm after it: the restore and the dissolve happen here
    calm_rps: float = 0.3  # the burst (3 rps) fills every worker's KV but leaves the 2 cores some room
    burst_factor: float = 10.0
    prompt_tokens: tuple[int, int] = (32, 96)  # [low, high)
    calm_output: tuple[int, int] = (16, 48)
    burst_output: tuple[int, int] = (128, 192)  # long outputs: the KV grows while they decode
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.calm_s, self.tail_s) < 0 or self.burst_s <= 0:
            raise ValueError(f"need calm_s, tail_s >= 0 and burst_s > 0, got {self.calm_s}, {self.burst_s}, {self.tail_s}")
        if self.calm_rps <= 0 or self.burst_factor < 1:
            raise ValueError(f"need calm_rps > 0 and burst_factor >= 1, got {self.calm_rps}, {self.burst_factor}")
        for name in ("prompt_tokens", "calm_output", "burst_output"):
            low, high = getattr(self, name)
            if not 1 <= low < high:
                raise ValueError(f"{name} must be [low, high) with 1 <= low < high, got {(low, high)}")

    @property
    def duration_s(self) -> float:
        return self.calm_s + self.burst_s + self.tail_s


def burst_trace(spec: BurstSpec) -> list[TraceRecord]:
    """Calm, burst, calm; Poisson arrivals in each phase; ids `kun-<n>` in arrival order."""
    rng = np.random.default_rng(spec.seed)
    phases = [(0.0, spec.calm_s, spec.calm_rps, spec.calm_output),
              (spec.calm_s, spec.calm_s + spec.burst_s, spec.calm_rps * spec.burst_factor, spec.burst_output),
              (spec.calm_s + spec.burst_s, spec.duration_s, spec.calm_rps, spec.calm_output)]
    out: list[TraceRecord] = []
    for start, end, rate, output in phases:
        t = start + rng.exponential(1 / rate)
        while t < end:
            out.append(TraceRecord(arrival_s=round(t, 4), model=spec.model,
                                   prompt_tokens=int(rng.integers(*spec.prompt_tokens)),
                                   output_tokens=int(rng.integers(*output))))
            t += rng.exponential(1 / rate)
    return [TraceRecord(arrival_s=r.arrival_s, model=r.model, prompt_tokens=r.prompt_tokens,
                        output_tokens=r.output_tokens, request_id=f"kun-{i}") for i, r in enumerate(out)]


@dataclass
class PlanTally:
    """KunServe's plan events of one phase: actions decided and how each ended, by kind."""

    decided: Counter[str] = field(default_factory=Counter)  # form / drop / restore / dissolve
    applied: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)  # "<kind>: <message>"
    kinds: dict[str, str] = field(default_factory=dict)  # plan id -> kind

    def add(self, event: PlanEvent) -> None:
        if isinstance(event, PlanDecided):
            action = event.plan.actions[0] if event.plan.actions else None
            kind = KUN_ACTIONS.get(type(action))
            if kind is not None:
                self.kinds[event.plan.plan_id] = kind
                self.decided[kind] += 1
        elif isinstance(event, PlanApplied) and event.plan_id in self.kinds:
            self.applied[self.kinds[event.plan_id]] += 1
        elif isinstance(event, (PlanFailed, PlanCancelled)) and event.plan_id in self.kinds:
            self.failed.append(f"{self.kinds[event.plan_id]}: {event.message}")

    def brief(self) -> str:
        return (f"groups formed {self.applied['form']}/{self.decided['form']}, layer drops {self.applied['drop']}/"
                f"{self.decided['drop']}, restores {self.applied['restore']}/{self.decided['restore']}, dissolved "
                f"{self.applied['dissolve']}/{self.decided['dissolve']} (applied/decided), failed {len(self.failed)}")


@dataclass
class PhaseFigures:
    name: str  # "groups" or "no-groups"
    requests: int
    lost: int  # not ok, or short of the tokens asked for
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float  # over every gap between streamed tokens
    tbt_p99_s: float
    lost_reasons: list[str] = field(default_factory=list)


def phase_figures(name: str, trace: list[TraceRecord], records: list[RequestRecord]) -> PhaseFigures:
    want = {r.request_id: r.output_tokens for r in trace}
    ok = [r for r in records if r.status == "ok" and r.output_tokens == want.get(r.request_id)]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [b - a for r in ok for a, b in zip(r.token_times_s or [], (r.token_times_s or [])[1:])]
    done = {r.request_id for r in ok}
    reasons = [f"{r.request_id} {r.status} {r.output_tokens}/{want.get(r.request_id)} {r.error}"
               for r in records if r.request_id not in done]
    return PhaseFigures(name, requests=len(want), lost=len(want) - len(done & set(want)),
                        ttft_p50_s=quantile(ttft, 0.5), ttft_p99_s=quantile(ttft, 0.99),
                        tbt_p50_s=quantile(gaps, 0.5), tbt_p99_s=quantile(gaps, 0.99), lost_reasons=reasons[:20])


def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q)) if values else math.nan


@dataclass(frozen=True)
class LiveHeadline:
    ttft_ratio: float  # no-groups P99 TTFT over groups P99 TTFT: higher = better
    tbt_ratio: float  # groups P50 TBT over no-groups P50 TBT: the pipeline's price

    def line(self) -> str:
        return (f"repro kunserve (live): live_p99_ttft_vs_no_groups={self.ttft_ratio:.1f}x "
                f"live_p50_tbt_vs_no_groups={self.tbt_ratio:.2f}x")


def live_headline(groups: PhaseFigures, no_groups: PhaseFigures) -> LiveHeadline:
    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else math.inf
    return LiveHeadline(ttft_ratio=ratio(no_groups.ttft_p99_s, groups.ttft_p99_s),
                        tbt_ratio=ratio(groups.tbt_p50_s, no_groups.tbt_p50_s))


def parse_line(text: str) -> LiveHeadline:
    """The figures of a summary line; a clear error for anything else."""
    match = LINE.match(text.strip())
    if match is None:
        raise ValueError(f"not a `repro kunserve (live)` summary line: {text!r}")
    return LiveHeadline(ttft_ratio=float(match.group(1)), tbt_ratio=float(match.group(2)))


__all__ = ["BurstSpec", "LiveHeadline", "PhaseFigures", "PlanTally", "burst_trace", "live_headline", "parse_line",
           "phase_figures", "quantile"]
