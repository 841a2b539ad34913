"""`tidal bench prefix`'s figures (pure): per-arm TTFT percentiles and throughput, hit rates from the
workers' PrefixSummary counters, the cuts between arms and the summary line."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ARMS = ("off", "on", "routed")  # caching off; on (routing by load); on + prefix-aware routing
ARM_LABELS = {"off": "caching off", "on": "caching on", "routed": "caching on + prefix routing"}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request of one arm."""

    index: int  # the trace record's
    shape: str  # "chat" or "system"
    sent: float  # seconds from the arm's start
    ttft_s: float | None  # None: failed
    e2e_s: float | None
    tokens: int  # completion tokens
    text: str  # the greedy output
    error: str | None = None


@dataclass(slots=True)
class ArmResult:
    arm: str
    outcomes: list[Outcome] = field(default_factory=list)
    # worker -> (queried, hit) blocks, cumulative, from its instances' last summaries
    hits: dict[str, tuple[int, int]] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)  # worker -> requests it served (the dispatcher's pick)

    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ttft_s is not None and o.error is None]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft(arm: ArmResult, q: float, shape: str | None = None) -> float:
    return percentile([o.ttft_s for o in arm.ok() if shape is None or o.shape == shape], q)  # type: ignore[misc]


def throughput(arm: ArmResult) -> tuple[float, float]:
    """(completion tokens/s, requests/s) from the first send to the last finish."""
    ok = arm.ok()
    if not ok:
        return 0.0, 0.0
    start = min(o.sent for o in ok)
    end = max(o.sent + (o.e2e_s or 0.0) for o in ok)
    span = max(end - start, 1e-9)
    return sum(o.tokens for o in ok) / span, len(ok) / span


def hit_rate(hits: Mapping[str, tuple[int, int]]) -> float | None:
    """Hit blocks / looked-up blocks over every worker (None: nothing looked up, e.g. caching off)."""
    queried = sum(q for q, _ in hits.values())
    return None if queried == 0 else sum(h for _, h in hits.values()) / queried


def tokens_equal(arms: Sequence[ArmResult]) -> bool:
    """Every request that finished in every arm produced the same greedy output in each, and each arm
    finished every request."""
    texts = [{o.index: o.text for o in arm.ok()} for arm in arms]
    if not texts or any(len(t) != len(arm.outcomes) for t, arm in zip(texts, arms)):
        return False
    return all(t == texts[0] for t in texts[1:])


def cut(before: float, after: float) -> float:
    return before / after if after > 0 and not math.isnan(before) and not math.isnan(after) else math.nan


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.0f}%"


def arm_lines(arm: ArmResult) -> list[str]:
    tok_s, req_s = throughput(arm)
    lines = [f"{ARM_LABELS[arm.arm]:<28} ttft p50 {1000 * ttft(arm, 50):7.0f} ms  p99 {1000 * ttft(arm, 99):7.0f} ms  "
             f"(chat p50 {1000 * ttft(arm, 50, 'chat'):6.0f}, system p50 {1000 * ttft(arm, 50, 'system'):6.0f})  "
             f"{tok_s:6.1f} tok/s  {req_s:5.2f} req/s  ok {len(arm.ok())}/{len(arm.outcomes)}"]
    for worker in sorted(set(arm.hits) | set(arm.routes)):
        q, h = arm.hits.get(worker, (0, 0))
        lines.append(f"  {worker:<10} requests {arm.routes.get(worker, 0):4d}  hit rate "
                     f"{_pct(h / q if q else None):>4} ({h}/{q} blocks)")
    return lines


def summary_line(arms: Mapping[str, ArmResult]) -> str:
    off, on, routed = arms["off"], arms["on"], arms["routed"]
    equal = tokens_equal([off, on, routed])
    return (f"bench prefix: ttft_p50_cut={cut(ttft(off, 50), ttft(routed, 50)):.1f}x "
            f"ttft_p99_cut={cut(ttft(off, 99), ttft(routed, 99)):.1f}x hit_rate={_pct(hit_rate(on.hits))} "
            f"routed_hit_rate={_pct(hit_rate(routed.hits))} tokens_equal={'yes' if equal else 'no'}")


__all__ = ["ARMS", "ARM_LABELS", "ArmResult", "Outcome", "arm_lines", "cut", "hit_rate", "percentile", "summary_line",
           "throughput", "tokens_equal", "ttft"]
