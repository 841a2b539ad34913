"""`tidal bench serve TRACE [--url URL] [--out DIR] [--slo-...]`: a trace, open loop, against a gateway.

Every record of the trace is sent at its arrival time (divided by --time-scale) as a
streaming completion (token-id prompt of its length, `max_tokens` = its output length,
`ignore_eos`), whatever earlier requests are doing. Before anything is sent, the trace's
models are checked against the gateway's /v1/models: a trace naming a model the cluster does
not serve is refused with the served list (`--model-map OLD=NEW` renames trace models at
load), records longer than their model's context are reported (they are shortened), and the
trace's offered load is compared with a short probe of the cluster (loadgen/runner/capacity.py):
a trace the cluster cannot keep up with is warned about, with the numbers (`--no-probe`: skip).
While it runs: a progress bar and a table of the run so far (in flight, streamed tokens/s). Ctrl-C
stops sending, lets running streams finish for `--drain` seconds (a second Ctrl-C: not), aborts the
rest and writes the partial report of what was sent (exit 130). Then the report
(`loadgen/report`: records.jsonl, summary.json, report.md, cdf.png, timeline.png with
per-worker memory by kind and plan events when the bus is reachable), the client's own
overhead, and on the last line SLO attainment and achieved vs offered throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from tidal.bench.output import add_out_argument, out_dir

DEFAULT_URL = "http://127.0.0.1:8000"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a trace open-loop against a gateway; writes the SLO report")
    p.add_argument("trace", help="trace file (from `tidal trace`)")
    p.add_argument("--url", default=None, help="the gateway (default: the running `tidal up` cluster's, as "
                   f"`tidal status` finds it, else {DEFAULT_URL})")
    add_out_argument(p, "serve")  # the report's directory
    p.add_argument("--time-scale", type=float, default=1.0, help="divide the trace's arrival times by this")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests of the trace")
    p.add_argument("--model-map", action="append", default=[], metavar="OLD=NEW",
                   help="send the trace's model (or adapter) OLD as NEW (repeatable), e.g. model-0=demo-llama")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO in milliseconds")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="TPOT SLO in milliseconds")
    p.add_argument("--slo-e2e", type=float, default=None, metavar="MS", help="end-to-end SLO in milliseconds")
    p.add_argument("--slo-scale", type=float, default=None, metavar="K",
                   help="TTFT and TPOT SLOs = K x their unloaded P50, measured first (KunServe uses 5)")
    p.add_argument("--baseline-requests", type=int, default=10,
                   help="requests sent one at a time for the unloaded P50 of --slo-scale")
    p.add_argument("--nats", default=None, help="NATS url, to record worker memory and plan events "
                   "(default: the running `tidal up` cluster's, found as `tidal status` finds it)")
    p.add_argument("--state", "--data-dir", dest="data_dir", default=None, metavar="DIR",
                   help="the running cluster's data directory (holding run.json), to find its NATS")
    p.add_argument("--no-probe", action="store_true", help="do not probe the cluster's capacity before sending")
    p.add_argument("--drain", type=float, default=10.0, metavar="SECONDS",
                   help="after Ctrl-C, how long running streams may finish before they are aborted")
    p.add_argument("--no-bus", action="store_true", help="do not listen on the bus")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as timeout")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    p.add_argument("--no-live", action="store_true", help="no progress bar or live table (e.g. in CI logs)")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.set_defaults(func=run)


def _slo(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from loadgen.report.metrics import SloSpec

    ms = {k: (None if v is None else v / 1000) for k, v in
          (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot), ("e2e_s", args.slo_e2e))}
    return SloSpec(**ms) if any(v is not None for v in ms.values()) else None


async def _serve(args: argparse.Namespace, trace, slo):  # type: ignore[no-untyped-def]
    from loadgen.report.metrics import SloSpec
    from loadgen.runner.baseline import live_unloaded_baseline
    from loadgen.runner.bus_watch import BusWatch, find_nats
    from loadgen.runner.capacity import fit_notes, offered_load, probe_capacity
    from loadgen.runner.runner import (
        LoadRunner, RunnerConfig, RunProgress, model_cards, served_context, served_names,
    )
    from loadgen.runner.trace_fit import check_served, length_notes

    config = RunnerConfig(url=args.url, time_scale=args.time_scale, request_timeout_s=args.request_timeout,
                          seed=args.seed, drain_s=args.drain)
    cards = await asyncio.to_thread(model_cards, args.url)
    context = served_context(args.url, cards=cards)
    check_served(trace, served_names(cards), args.url)  # before anything is sent
    for note in length_notes(trace, context):
        print(f"note: {note}", file=sys.stderr)
    if not args.no_probe:
        capacity = await probe_capacity(trace, args.url, context)
        offered = offered_load(trace)
        print(f"capacity: {capacity.output_rate:.0f} output tokens/s in a probe ({capacity.streams} streams to "
              f"{capacity.model}, {capacity.wall_s:.1f} s); the trace offers {offered.output_rate:.0f} on average, "
              f"{offered.peak_output_rate:.0f} in its busiest 30 s", file=sys.stderr)
        for note in fit_notes(offered, capacity):
            print(f"warning: {note}", file=sys.stderr)
    baseline = None
    if args.slo_scale is not None:
        baseline = await live_unloaded_baseline(trace, config, context, args.baseline_requests)
        scaled = SloSpec.scaled(args.slo_scale, baseline)
        slo = SloSpec(ttft_s=scaled.ttft_s, tpot_s=scaled.tpot_s, e2e_s=slo.e2e_s if slo else None)
    watch = None
    nats_url = None
    if not args.no_bus:
        nats_url, where = (args.nats, "--nats") if args.nats else find_nats(args.data_dir)
        if nats_url is None:
            print(f"note: not recording worker memory or plan events: {where} (pass --nats URL or --state DIR; "
                  "--no-bus to skip)", file=sys.stderr)
    if nats_url:
        try:
            watch = await BusWatch().start(nats_url)
        except Exception as exc:  # the report is still useful without the overlay
            print(f"warning: not recording worker memory ({nats_url}: {exc})", file=sys.stderr)
            watch = None
    progress = RunProgress()
    runner = LoadRunner(trace, config, context=context, progress=progress)
    if watch is not None:
        watch.t0_unix = time.time() + config.lead_s
    view_task = None
    if not args.no_live:
        from tidal.bench.serve_view import LiveView

        view_task = asyncio.create_task(LiveView(progress, f"tidal bench serve {Path(args.trace).name}").run())
    loop = asyncio.get_running_loop()
    # Ctrl-C: stop sending and drain (a second one: abort), then the partial report; never a traceback
    loop.add_signal_handler(signal.SIGINT, lambda: _interrupted(runner, args.drain))
    try:
        outcome = await runner.run()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if view_task is not None:
            view_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await view_task
        if watch is not None:
            await watch.stop()
    return outcome, watch, slo, baseline


def _interrupted(runner, drain_s: float) -> None:  # type: ignore[no-untyped-def]
    if runner.progress.stopping:
        print("\ninterrupted again: aborting the streams still running", file=sys.stderr, flush=True)
    else:
        print(f"\ninterrupted: sending stopped; waiting up to {drain_s:g} s for the streams running "
              "(Ctrl-C again: abort them)", file=sys.stderr, flush=True)
    runner.stop()


def run(args: argparse.Namespace) -> int:
    import os

    from loadgen.report.markdown import render_markdown
    from loadgen.report.write import write_report
    from loadgen.runner.trace_fit import map_models, parse_model_map
    from loadgen.traces.io import TraceFormatError, read_trace, scale_time

    started = time.time()
    if args.url is None:  # the running cluster's gateway (its config may not use port 8000)
        from loadgen.runner.bus_watch import find_cluster

        state, _where = find_cluster(args.data_dir)
        args.url = state.gateway_url if state is not None else DEFAULT_URL
    try:
        mapping = parse_model_map(args.model_map)
        loaded = read_trace(args.trace)
        if args.time_scale != 1.0:
            loaded = scale_time(loaded, args.time_scale)
            args.time_scale = 1.0  # already applied to the records
        trace = map_models(loaded.records[: args.limit] if args.limit is not None else loaded.records, mapping)
        if not trace:
            raise ValueError(f"{args.trace}: no requests to send")
        slo = _slo(args)
        outcome, watch, slo, baseline = asyncio.run(_serve(args, trace, slo))
    except (ValueError, TraceFormatError, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the first request: nothing to report
        print("\ninterrupted before sending anything: no report", file=sys.stderr)
        return 130
    out = out_dir(args, started)
    records = outcome.records
    interrupted = outcome.unsent > 0 or outcome.aborted > 0
    if not records:
        print("interrupted before sending anything: no report", file=sys.stderr)
        return 130
    sent = trace[: len(records)]  # requests are sent in trace order: the unsent ones are the tail
    end = max((r.finish_s or r.arrival_s) for r in records)
    memory, plans = watch.window(end) if watch is not None else (None, None)
    span = sent[-1].arrival_s - sent[0].arrival_s
    offered = (len(sent) - 1) / span if span > 0 else float("nan")
    extra = {"trace": str(args.trace), "gateway": args.url, "offered load": f"{offered:.3f} req/s",
             "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()), **outcome.overhead.as_extra()}
    if interrupted:
        extra["interrupted"] = (f"Ctrl-C after {len(records)} of {len(trace)} requests were sent; {outcome.aborted} "
                                f"still streaming after the {args.drain:g} s wait were aborted")
    if outcome.clamped:
        extra["clamped"] = f"{outcome.clamped} requests shortened to fit the model's context"
    if baseline is not None and baseline.ttft is not None:
        tpot = f"{baseline.tpot.p50 * 1000:.1f} ms" if baseline.tpot else "-"
        extra["unloaded baseline"] = f"TTFT P50 {baseline.ttft.p50 * 1000:.1f} ms, TPOT P50 {tpot}"
    summary = write_report(out, records, slo=slo, title=f"tidal bench serve {Path(args.trace).name}",
                           memory=memory or None, plans=plans or None, extra=extra, plots=not args.no_plots)
    print(render_markdown(summary, extra))
    print(f"{'partial report (interrupted: ' + extra['interrupted'] + ')' if interrupted else 'report'} in {out}")
    failures = Counter(r.error or r.status for r in records if r.status != "ok")
    for error, count in failures.most_common(3):
        print(f"failed: {count} x {error}", file=sys.stderr)
    attain = f"SLO attainment {summary.slo.attainment:.1%}, " if summary.slo is not None else ""
    ratio = summary.request_throughput / offered if offered == offered and offered > 0 else float("nan")
    print(f"serve: {summary.completed}/{summary.requests} ok, {attain}throughput {summary.request_throughput:.3f} "
          f"req/s vs offered {offered:.3f} req/s (ratio {ratio:.2f})" + (" [interrupted]" if interrupted else ""))
    if interrupted:
        return 130
    return 0 if summary.completed == summary.requests else 1
