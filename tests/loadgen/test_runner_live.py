"""The live runner against a real cluster (nats-server, registry, dispatcher, one gpu_worker,
gateway — real processes, tiny checkpoints).

Timing check: what the client measures must agree with what the cluster itself saw. The
worker publishes one TokenChunk per engine step of a request on the bus; a read-only bus
listener in this process stamps each chunk on arrival (`perf_counter`, the runner's clock),
which is the worker's publish time plus one local NATS hop. The client's TTFT and inter-token
gaps are compared per request against those stamps, and its mean TTFT against the gateway's
own TTFT histogram (`/metrics`: HTTP arrival to first token chunk).
"""
from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from e2e.assets import LLAMA, LORA, TinyAssets, make_assets
from e2e.cluster import ClusterSpec, E2ECluster
from loadgen.report.records import read_records
from loadgen.runner.runner import RunnerConfig, run_trace
from loadgen.traces.schema import TraceRecord
from shared.bus import Bus, BusSettings, Delivery
from shared.events import StreamMessage, TokenChunk
from shared.subjects import CATALOG

pytestmark = pytest.mark.timeout(180)

SPEC = ClusterSpec(workers={"w0": [LLAMA]}, resident_adapters={"w0": [LORA]}, max_batch=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return make_assets(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="module")
def live(tiny: TinyAssets, tmp_path_factory: pytest.TempPathFactory):
    running = E2ECluster(tmp_path_factory.mktemp("cluster"), SPEC, tiny).start()
    try:
        yield running
    finally:
        running.stop()


class ChunkClock:
    """Bus arrival time (perf_counter) of every token-carrying chunk, per bus request id."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.bus: Bus | None = None

    async def start(self, url: str) -> "ChunkClock":
        self.bus = await Bus.connect(BusSettings(url=url), service="cli")
        out = CATALOG["request.out"].wildcard
        await self.bus.subscribe(out, StreamMessage, self._on, label=out)
        return self

    async def _on(self, msg: StreamMessage, _ctx: Delivery) -> None:
        if isinstance(msg, TokenChunk) and msg.token_ids:
            self.times.setdefault(msg.request_id, []).append(time.perf_counter())


def _gateway_ttft(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    total = sum(float(v) for v in re.findall(r'^tidal_gateway_ttft_seconds_sum\{route="/v1/completions"\} (\S+)', text, re.M))
    count = sum(float(v) for v in re.findall(r'^tidal_gateway_ttft_seconds_count\{route="/v1/completions"\} (\S+)', text, re.M))
    return total, count


def _poisson(n: int, rate: float, prompt: int, output: int, seed: int, adapter_every: int = 0) -> list[TraceRecord]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [TraceRecord(arrival_s=round(float(x), 6), model=LLAMA, prompt_tokens=prompt, output_tokens=output,
                        adapter=LORA if adapter_every and i % adapter_every == 0 else None, request_id=f"req-{i}")
            for i, x in enumerate(t)]


async def test_client_timing_agrees_with_the_workers_chunks(live: E2ECluster) -> None:
    clock = await ChunkClock().start(live.nats_url)
    try:
        sum0, count0 = _gateway_ttft(live.base_url)
        trace = _poisson(12, rate=6.0, prompt=40, output=24, seed=1)
        outcome = await run_trace(trace, RunnerConfig(url=live.base_url, request_timeout_s=60))
        sum1, count1 = _gateway_ttft(live.base_url)
    finally:
        assert clock.bus is not None
        await clock.bus.close()
    t0 = outcome.t0_perf
    ttft_gaps, itl_diffs = [], []
    client_ttft_from_send = []
    for res in outcome.results:
        rec = res.record
        assert rec.status == "ok", rec.error
        assert rec.output_tokens == 24 and rec.token_times_s is not None
        assert res.response_id is not None and res.sent_s is not None
        bus = [t - t0 for t in clock.times[f"{res.response_id}-0"]]
        # the worker coalesces tokens (`stream_interval`): one SSE event per chunk on the bus
        assert len(rec.token_times_s) == len(bus) >= 2, (len(rec.token_times_s), len(bus))
        # the client sees each token after the bus did (the gateway relays it), and not much later
        ttft_gaps.append(rec.token_times_s[0] - bus[0])
        client_ttft_from_send.append(rec.token_times_s[0] - res.sent_s)
        itl_diffs += list(np.diff(rec.token_times_s) - np.diff(bus))
        assert abs((rec.token_times_s[-1] - rec.token_times_s[0]) - (bus[-1] - bus[0])) < 0.05
    print(f"client - bus first token: median {np.median(ttft_gaps) * 1000:.2f} ms, max {max(ttft_gaps) * 1000:.2f} ms; "
          f"|ITL diff| median {np.median(np.abs(itl_diffs)) * 1000:.3f} ms")
    assert -0.002 < float(np.median(ttft_gaps)) < 0.030, ttft_gaps
    assert max(ttft_gaps) < 0.25, ttft_gaps
    assert float(np.median(np.abs(itl_diffs))) < 0.005, "inter-token gaps match the worker's step cadence"
    # the gateway's own TTFT (HTTP arrival -> first chunk) is a little below the client's (send -> first event)
    assert count1 - count0 == len(trace)
    gateway_mean = (sum1 - sum0) / (count1 - count0)
    client_mean = float(np.mean(client_ttft_from_send))
    print(f"mean TTFT: client (from send) {client_mean * 1000:.2f} ms, gateway {gateway_mean * 1000:.2f} ms")
    assert -0.002 < client_mean - gateway_mean < 0.030, (client_mean, gateway_mean)
    over = outcome.overhead
    assert over.requests == 12 and over.tokens == 12 * 24 and over.cpu_s > 0 and over.send_lag_max_ms >= 0


def test_bench_serve_runs_a_trace_and_writes_the_report(live: E2ECluster, tmp_path: Path) -> None:
    from loadgen.traces.io import write_trace
    from loadgen.traces.schema import PoissonParams, Trace, TraceHeader

    records = _poisson(36, rate=12.0, prompt=24, output=12, seed=2, adapter_every=4)
    header = TraceHeader(params=PoissonParams(rate=12.0, model=LLAMA), num_records=len(records),
                         duration_s=records[-1].arrival_s)
    path = write_trace(tmp_path / "trace.jsonl", Trace(header=header, records=records))
    from tidal.cli import main

    out = tmp_path / "report"
    code = main(["bench", "serve", str(path), "--url", live.base_url, "--out", str(out),
                 "--nats", live.nats_url, "--slo-ttft", "2000"])
    assert code == 0
    got = read_records(out / "records.jsonl")
    assert [r.request_id for r in got] == [r.request_id for r in records]
    assert all(r.status == "ok" and r.output_tokens == 12 for r in got)
    assert sum(r.adapter == LORA for r in got) == 9
    for name in ("summary.json", "report.md", "cdf.png", "timeline.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "client overhead" in report and "| TTFT |" in report
