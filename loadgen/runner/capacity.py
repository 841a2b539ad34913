"""Will the cluster keep up with the trace? The trace's offered load beside a short probe of what the
cluster generates, compared before anything is sent.

Offered: requests/s and output tokens/s over the whole trace, and the output tokens/s of its busiest
window of at least `PROBE_STREAMS` requests (bursts; a few requests close together are not one). Capacity: `PROBE_STREAMS` streams sent at once to the trace's commonest model, each
`PROBE_OUTPUT` tokens after a prompt of the trace's median length; their output tokens over the wall time
the probe took is what the cluster generated (a lower bound: a fuller batch goes faster per token, up
to its memory). A trace whose mean is above it queues for the whole run (then 429s: the dispatcher's
queue is bounded); one whose bursts are, during them. `fit_notes` says which, with the numbers.
"""
from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.traces.schema import TraceRecord

PROBE_STREAMS = 8
PROBE_OUTPUT = 32
PROBE_TIMEOUT_S = 60.0
BURST_WINDOW_S = 30.0  # as long as a BurstGPT burst; a request's tokens come over seconds, not at its arrival


@dataclass(frozen=True)
class OfferedLoad:
    requests: int
    span_s: float  # first to last arrival
    request_rate: float  # requests/s over the span
    output_tokens: int
    output_rate: float  # output tokens/s over the span
    peak_output_rate: float  # output tokens/s of the busiest BURST_WINDOW_S window


@dataclass(frozen=True)
class ProbedCapacity:
    model: str
    streams: int
    output_tokens: int
    wall_s: float
    failed: int

    @property
    def output_rate(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def offered_load(trace: Sequence[TraceRecord], window_s: float = BURST_WINDOW_S,
                 min_requests: int = PROBE_STREAMS) -> OfferedLoad:
    span = trace[-1].arrival_s - trace[0].arrival_s if trace else 0.0
    total = sum(r.output_tokens for r in trace)
    peak, lo, in_window = 0, 0, 0
    for hi, rec in enumerate(trace):  # sliding window over arrivals (sorted): output tokens arriving within it
        in_window += rec.output_tokens
        while rec.arrival_s - trace[lo].arrival_s > window_s:
            in_window -= trace[lo].output_tokens
            lo += 1
        if hi - lo + 1 >= min_requests:
            peak = max(peak, in_window)
    if span <= 0:  # every request at once
        return OfferedLoad(len(trace), 0.0, float("inf"), total, float("inf"), float("inf"))
    return OfferedLoad(requests=len(trace), span_s=span, request_rate=len(trace) / span, output_tokens=total,
                       output_rate=total / span, peak_output_rate=max(peak / min(window_s, span), total / span))


def probe_trace(trace: Sequence[TraceRecord], streams: int = PROBE_STREAMS,
                output: int = PROBE_OUTPUT) -> list[TraceRecord]:
    """`streams` requests at time 0 for the trace's commonest model (or adapter), median prompt length."""
    (model, adapter), _n = Counter((r.model, r.adapter) for r in trace).most_common(1)[0]
    prompt = max(1, min(512, int(statistics.median(r.prompt_tokens for r in trace))))
    return [TraceRecord(arrival_s=0.0, model=model, adapter=adapter, prompt_tokens=prompt, output_tokens=output,
                        request_id=f"capacity-probe-{i}") for i in range(streams)]


async def probe_capacity(trace: Sequence[TraceRecord], url: str, context: dict[str, int],
                         streams: int = PROBE_STREAMS) -> ProbedCapacity:
    """Send the probe (real requests to the gateway at `url`) and time it."""
    from loadgen.runner.runner import LoadRunner, RunnerConfig

    probe = probe_trace(trace, streams)
    outcome = await LoadRunner(probe, RunnerConfig(url=url, request_timeout_s=PROBE_TIMEOUT_S, lead_s=0.0),
                               context=context).run()
    records = outcome.records
    ok = [r for r in records if r.status == "ok"]
    ends = [r.finish_s for r in ok if r.finish_s is not None]
    return ProbedCapacity(model=probe[0].adapter or probe[0].model, streams=streams,
                          output_tokens=sum(r.output_tokens for r in ok), wall_s=max(ends, default=0.0),
                          failed=len(records) - len(ok))


def fit_notes(offered: OfferedLoad, capacity: ProbedCapacity) -> list[str]:
    """Warnings when the trace asks for more than the probe saw the cluster generate (empty: it fits)."""
    probe = (f"a probe of {capacity.streams} streams x {PROBE_OUTPUT} tokens to {capacity.model} "
             f"generated {capacity.output_rate:.0f} output tokens/s")
    if capacity.output_tokens == 0:
        return [f"the capacity probe got no tokens ({capacity.failed} of {capacity.streams} requests failed): "
                "the cluster may not serve this trace at all"]
    trace = (f"the trace offers {offered.output_rate:.0f} output tokens/s on average ({offered.requests} requests, "
             f"{offered.output_tokens} output tokens over {offered.span_s:.0f} s)")
    if offered.output_rate > capacity.output_rate:
        scale = capacity.output_rate / offered.output_rate
        return [f"{trace}, {offered.output_rate / capacity.output_rate:.1f}x what {probe}: requests will queue "
                f"for the whole run and, past the dispatcher's queue bound, be refused (429). To fit, try "
                f"--time-scale {scale * 0.8:.2g} (slower arrivals) or a smaller trace (--limit N)."]
    if offered.peak_output_rate > capacity.output_rate:
        return [f"{trace}, within what {probe}, but its busiest {BURST_WINDOW_S:.0f} s offer "
                f"{offered.peak_output_rate:.0f} tokens/s: expect queueing during bursts."]
    return []


__all__ = ["OfferedLoad", "ProbedCapacity", "fit_notes", "offered_load", "probe_capacity", "probe_trace"]
