"""Open-loop load against the gateway: each trace record is sent at its arrival time,
whether or not earlier requests have finished, over streaming HTTP.

The clock is `time.perf_counter()`, shifted so the run starts at 0; a record's `arrival_s`
is its scheduled (trace) time, so client lateness counts against the server's latency as a
real user would see it — the lag itself is measured and reported (`overhead.py`). The
schedule loop builds each payload before sleeping to its arrival, then starts one task per
request; tasks share a pool of keep-alive connections.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from loadgen.report.records import RequestRecord
from loadgen.runner.overhead import ClientOverhead, measure_overhead
from loadgen.runner.payloads import DEFAULT_ID_RANGE, PayloadMaker, PreparedRequest
from loadgen.runner.stream import ConnectionPool, StreamResult, StreamTally
from loadgen.traces.schema import TraceRecord

COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class RunnerConfig:
    url: str = "http://127.0.0.1:8000"
    time_scale: float = 1.0  # divide arrival times by this
    request_timeout_s: float = 600.0
    seed: int = 0
    id_range: tuple[int, int] = DEFAULT_ID_RANGE
    lead_s: float = 0.05  # the schedule starts this long after the run begins (payload warm-up)
    drain_s: float = 10.0  # after stop(): how long streams still running may go on before they are aborted


@dataclass(slots=True)
class LiveResult:
    """One request's record plus what only a live run knows."""

    record: RequestRecord
    sent_s: float | None  # when its bytes were written (run clock)
    response_id: str | None  # the gateway's `id` (its bus request ids are `<id>-<choice>`)
    start_lag_s: float
    clamped: bool


@dataclass
class RunProgress:
    """Counters a progress display reads while the run goes on (single-threaded: no locks)."""

    total: int = 0
    sent: int = 0
    done: int = 0
    ok: int = 0
    failed: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    tokens: int = 0
    recent_ttft_s: list[float] = field(default_factory=list)  # last 200 successful TTFTs
    recent_tpot_s: list[float] = field(default_factory=list)
    last_error: str = ""
    started: float = 0.0  # perf_counter of the run's time 0
    streams: StreamTally = field(default_factory=StreamTally)  # what unfinished streams received so far
    stopping: bool = False  # stop() was called: nothing more is sent

    @property
    def streamed_tokens(self) -> int:
        """Tokens received so far: exact for finished requests, token events for running ones."""
        return self.tokens + self.streams.events


@dataclass
class RunOutcome:
    results: list[LiveResult]
    overhead: ClientOverhead
    t0_perf: float  # perf_counter of the run's time 0
    t0_unix: float  # time.time() at the run's time 0 (for bus events stamped in Unix time)
    clamped: int
    unsent: int = 0  # stopped early: requests of the trace never sent
    aborted: int = 0  # stopped early: streams still running after the drain wait, cut off

    @property
    def records(self) -> list[RequestRecord]:
        return [r.record for r in self.results]


def model_cards(url: str, timeout_s: float = 10.0) -> list[dict[str, object]]:
    """The gateway's model list (GET /v1/models): one card per model and adapter."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConnectionError(f"cannot list models at {url}/v1/models: {exc}") from None
    return [card for card in body.get("data", []) if isinstance(card, dict) and "id" in card]


def served_context(url: str, timeout_s: float = 10.0, cards: list[dict[str, object]] | None = None) -> dict[str, int]:
    """`max_model_len` of each model and adapter the gateway lists (GET /v1/models)."""
    out: dict[str, int] = {}
    for card in model_cards(url, timeout_s) if cards is None else cards:
        if isinstance(card.get("max_model_len"), int):
            out[str(card["id"])] = card["max_model_len"]  # type: ignore[assignment]
    return out


def served_names(cards: list[dict[str, object]]) -> list[str]:
    """The listed names, base models first (then adapters)."""
    return ([str(c["id"]) for c in cards if c.get("parent") is None]
            + [str(c["id"]) for c in cards if c.get("parent") is not None])


async def _wait(event: asyncio.Event, timeout: float) -> None:
    """Until `event` is set or `timeout` seconds pass."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass


def _record(p: PreparedRequest, res: StreamResult | None, arrival: float, t0: float, error: str | None,
            status: str) -> RequestRecord:
    rec = p.record
    if res is None:
        return RequestRecord(request_id=rec.request_id or f"req-{p.index}", model=rec.model, arrival_s=arrival,
                             prompt_tokens=p.prompt_tokens, output_tokens=0, status=status,  # type: ignore[arg-type]
                             finish_s=time.perf_counter() - t0, adapter=rec.adapter, error=error)
    times = [t - t0 for t in res.token_times]
    tokens = res.completion_tokens if res.completion_tokens is not None else len(times)
    del times[max(tokens, 1):]  # an empty final event (no token) is not a token
    return RequestRecord(
        request_id=rec.request_id or f"req-{p.index}", model=rec.model, arrival_s=arrival,
        prompt_tokens=p.prompt_tokens, output_tokens=tokens if times else 0, status=status,  # type: ignore[arg-type]
        first_token_s=times[0] if times else None, finish_s=(res.done or time.perf_counter()) - t0,
        token_times_s=times or None, adapter=rec.adapter, error=error,
    )


class LoadRunner:
    def __init__(self, trace: Sequence[TraceRecord], config: RunnerConfig, *,
                 context: dict[str, int] | None = None, progress: RunProgress | None = None,
                 on_result: Callable[[LiveResult], None] | None = None, pool: ConnectionPool | None = None) -> None:
        split = urlsplit(config.url)
        if split.scheme != "http" or not split.hostname:
            raise ValueError(f"--url {config.url!r}: need http://HOST[:PORT] (https is not supported)")
        if config.time_scale <= 0:
            raise ValueError(f"time scale must be > 0, got {config.time_scale}")
        self.trace = trace
        self.config = config
        self.own_pool = pool is None
        self.progress = progress or RunProgress()
        self.pool = pool or ConnectionPool(split.hostname, split.port or 80, tally=self.progress.streams)
        self.maker = PayloadMaker(seed=config.seed, id_range=config.id_range, context=context)
        self.on_result = on_result
        self.results: list[LiveResult | None] = [None] * len(trace)
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()

    def stop(self) -> None:
        """Send nothing more; streams running may finish within `drain_s` (a second call: abort them now)."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()
        self.progress.stopping = True

    async def run(self) -> RunOutcome:
        cfg, prog = self.config, self.progress
        prog.total = len(self.trace)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        t0 = wall0 + cfg.lead_s
        t0_unix = time.time() + cfg.lead_s
        prog.started = t0
        tasks: list[asyncio.Task[None]] = []
        for i, rec in enumerate(self.trace):
            prepared = self.maker.prepare(i, rec)
            arrival = rec.arrival_s / cfg.time_scale
            delay = t0 + arrival - time.perf_counter()
            if delay > 0 and not self._stop.is_set():
                await _wait(self._stop, delay)
            if self._stop.is_set():
                break
            tasks.append(asyncio.create_task(self._one(prepared, arrival, t0)))
            prog.sent += 1
        aborted = await self._finish(tasks)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        if self.own_pool:
            self.pool.close()
        results = [r for r in self.results if r is not None]
        overhead = measure_overhead(
            requests=len(results), tokens=sum(r.record.output_tokens for r in results), wall_s=wall, cpu_s=cpu,
            start_lags=[r.start_lag_s for r in results],
            send_lags=[r.sent_s - r.record.arrival_s for r in results if r.sent_s is not None],
            connections=self.pool.opened, peak=prog.peak_in_flight)
        return RunOutcome(results, overhead, t0, t0_unix, sum(r.clamped for r in results),
                          unsent=len(self.trace) - len(tasks), aborted=aborted)

    async def _finish(self, tasks: list[asyncio.Task[None]]) -> int:
        """Until every request ended; once stopped, `drain_s` at most (or until a second stop), then the
        streams still running are aborted (their records say so). Returns how many were aborted."""
        pending = {t for t in tasks if not t.done()}
        while pending and not self._stop.is_set():
            stopped = asyncio.ensure_future(self._stop.wait())
            _done, pending = await asyncio.wait(pending | {stopped}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopped)
            stopped.cancel()
        if pending:
            hurried = asyncio.ensure_future(self._hurry.wait())
            deadline = time.perf_counter() + self.config.drain_s
            while pending and not self._hurry.is_set() and (left := deadline - time.perf_counter()) > 0:
                _done, pending = await asyncio.wait(pending | {hurried}, timeout=left,
                                                    return_when=asyncio.FIRST_COMPLETED)
                pending.discard(hurried)
            hurried.cancel()
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(pending)

    async def _one(self, p: PreparedRequest, arrival: float, t0: float) -> None:
        prog = self.progress
        start_lag = time.perf_counter() - t0 - arrival
        prog.in_flight += 1
        prog.peak_in_flight = max(prog.peak_in_flight, prog.in_flight)
        conn = self.pool.take()
        res: StreamResult | None = None
        try:
            res = await asyncio.wait_for(conn.post(COMPLETIONS, p.payload), self.config.request_timeout_s)
            self.pool.give_back(conn, res)
            status = "ok" if res.ok else ("rejected" if res.status in (429, 503) else "error")
            record = _record(p, res, arrival, t0, res.error, status)
        except TimeoutError:
            conn.close()
            record = _record(p, None, arrival, t0, f"no answer within {self.config.request_timeout_s} s", "timeout")
        except asyncio.CancelledError:
            conn.close()
            if not self._stop.is_set():
                raise  # not ours: the caller is going away
            prog.tokens += conn.events  # streamed before the cut: the live count never goes back
            record = _record(p, None, arrival, t0, f"aborted: still running {self.config.drain_s:g} s after the stop",
                             "aborted")
        except Exception as exc:  # a client bug must cost one record, not the run
            conn.close()
            record = _record(p, None, arrival, t0, f"client: {type(exc).__name__}: {exc}", "error")
        finally:
            prog.in_flight -= 1
            if self.pool.tally is not None:
                self.pool.tally.settle(conn)
        result = LiveResult(record, None if res is None else res.sent - t0, None if res is None else res.response_id,
                            start_lag, p.clamped)
        self.results[p.index] = result
        self._count(result)

    def _count(self, result: LiveResult) -> None:
        prog, rec = self.progress, result.record
        prog.done += 1
        prog.tokens += rec.output_tokens
        if rec.status == "ok":
            prog.ok += 1
            if rec.ttft_s is not None:
                prog.recent_ttft_s.append(rec.ttft_s)
                del prog.recent_ttft_s[:-200]
            if rec.tpot_s is not None:
                prog.recent_tpot_s.append(rec.tpot_s)
                del prog.recent_tpot_s[:-200]
        else:
            prog.failed += 1
            prog.last_error = rec.error or rec.status
        if self.on_result is not None:
            self.on_result(result)


async def run_trace(trace: Sequence[TraceRecord], config: RunnerConfig, *, progress: RunProgress | None = None,
                    context: dict[str, int] | None = None) -> RunOutcome:
    """Run `trace` against the gateway at `config.url` (model context limits read from it if not given)."""
    if context is None:
        context = await asyncio.to_thread(served_context, config.url)
    return await LoadRunner(trace, config, context=context, progress=progress).run()


__all__ = ["COMPLETIONS", "LiveResult", "LoadRunner", "RunOutcome", "RunProgress", "RunnerConfig", "model_cards",
           "run_trace", "served_context", "served_names"]
