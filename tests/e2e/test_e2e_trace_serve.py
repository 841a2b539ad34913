"""Long token-id prompts and traces against a live cluster (real processes, one worker).

A token-id prompt is bounded by max_prompt_tokens and the model's context, not by the 128
that bounds a list of prompts: 300 ids generate, through the official `openai` client.
`tidal trace` with the cluster's config names its default model, so `tidal bench serve`
runs it as it is; a trace made for other model names runs with `--model-map`. The live table
counts streams while they run; an overload is warned about before sending; Ctrl-C writes the
partial report.
"""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.assets import LLAMA
from e2e.cluster import ClusterSpec, E2ECluster
from loadgen.report.records import read_records
from loadgen.traces.io import read_trace, write_trace
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord
from tidal.cli import main

pytestmark = pytest.mark.timeout(240)

CLUSTER_SPEC = ClusterSpec(workers={"w0": [LLAMA]})
IDS = [16 + (i * 37) % 240 for i in range(300)]  # 300 token ids inside the tiny vocabulary


def test_a_300_id_prompt_generates(cluster: E2ECluster) -> None:
    client = cluster.openai()
    whole = client.completions.create(model=LLAMA, prompt=IDS, max_tokens=8, temperature=0)
    assert whole.usage is not None and whole.usage.prompt_tokens == 300 and whole.usage.completion_tokens == 8
    assert whole.choices[0].finish_reason == "length"
    stream = client.completions.create(model=LLAMA, prompt=IDS, max_tokens=8, temperature=0, stream=True)
    assert "".join(e.choices[0].text for e in stream if e.choices) == whole.choices[0].text


def serve(cluster: E2ECluster, trace: Path, out: Path, *extra: str) -> int:
    return main(["bench", "serve", str(trace), "--url", cluster.base_url, "--out", str(out), "--no-bus", "--no-live",
                 "--no-plots", *extra])


def test_a_default_trace_of_the_cluster_config_serves_as_it_is(cluster: E2ECluster, tmp_path: Path) -> None:
    trace = tmp_path / "default.jsonl"
    assert main(["trace", "poisson", "--config", str(cluster.config), "--duration", "3", "--rate", "2",
                 "--prompt-tokens", "300", "--output-tokens", "6", "--out", str(trace)]) == 0
    records = read_trace(trace).records
    assert {r.model for r in records} == {LLAMA} and records
    assert serve(cluster, trace, tmp_path / "report") == 0
    got = read_records(tmp_path / "report" / "records.jsonl")
    assert len(got) == len(records) and all(r.status == "ok" and r.output_tokens == 6 for r in got)
    assert all(r.prompt_tokens == 300 for r in got)


def test_a_trace_for_other_models_runs_with_model_map(cluster: E2ECluster, tmp_path: Path) -> None:
    records = [TraceRecord(arrival_s=i * 0.2, model="model-0", prompt_tokens=40, output_tokens=4, request_id=f"r{i}")
               for i in range(4)]
    trace = write_trace(tmp_path / "other.jsonl", Trace(header=TraceHeader(
        params=PoissonParams(), num_records=len(records), duration_s=0.6), records=records))
    assert serve(cluster, trace, tmp_path / "refused") == 2  # unmapped: refused, nothing sent
    assert not (tmp_path / "refused").exists()
    assert serve(cluster, trace, tmp_path / "mapped", "--model-map", f"model-0={LLAMA}") == 0
    got = read_records(tmp_path / "mapped" / "records.jsonl")
    assert [(r.request_id, r.model, r.status) for r in got] == [(f"r{i}", LLAMA, "ok") for i in range(4)]


def burst_trace(path: Path, n: int, span_s: float, output: int) -> Path:
    records = [TraceRecord(arrival_s=i * span_s / n, model=LLAMA, prompt_tokens=32, output_tokens=output,
                           request_id=f"b{i}") for i in range(n)]
    return write_trace(path, Trace(header=TraceHeader(params=PoissonParams(), num_records=n, duration_s=span_s),
                                   records=records))


async def test_the_live_table_counts_streams_and_their_tokens_before_any_request_ends(cluster: E2ECluster) -> None:
    from loadgen.runner.runner import LoadRunner, RunnerConfig, RunProgress
    from tidal.bench.serve_view import LiveView

    trace = [TraceRecord(arrival_s=0.0, model=LLAMA, prompt_tokens=16, output_tokens=600) for _ in range(4)]
    progress = RunProgress()
    view = LiveView(progress, "test")
    run = asyncio.ensure_future(LoadRunner(trace, RunnerConfig(url=cluster.base_url), progress=progress).run())
    seen = []
    while not run.done():
        row = view.row()
        if row["done"] == "0" and row["tok/s"] not in ("-", "0.0"):
            seen.append(row)
        await asyncio.sleep(0.05)
    outcome = await run
    assert all(r.status == "ok" for r in outcome.records)
    assert seen, "no sample with tokens streaming before the first request ended"
    assert int(seen[-1]["in flight"]) == 4 and int(seen[-1]["streaming"]) >= 1 and seen[-1]["TTFT ms P50/P99"] != "-"
    assert progress.streamed_tokens == progress.tokens == 4 * 600 and progress.streams.events == 0


def test_an_overload_is_warned_and_ctrl_c_writes_the_partial_report(cluster: E2ECluster, tmp_path: Path) -> None:
    trace = burst_trace(tmp_path / "burst.jsonl", 40, 4.0, 900)  # 9000 tokens/s: past a probe of the tiny model
    errors = tmp_path / "stderr.txt"  # a file, not a pipe: read while it runs without losing what follows
    with open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tidal", "bench", "serve", str(trace), "--url",
                                 cluster.base_url, "--no-bus", "--no-live", "--no-plots", "--drain", "1"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr, text=True)
        deadline = time.monotonic() + 60
        while "capacity:" not in errors.read_text():  # the probe's figures: sending starts right after
            assert proc.poll() is None and time.monotonic() < deadline, errors.read_text()
            time.sleep(0.1)
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    err = errors.read_text()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    warning = next(line for line in err.splitlines() if line.startswith("warning: the trace offers"))
    assert "output tokens/s on average (40 requests, 36000 output tokens over 4 s)" in warning and "--time-scale" in warning
    assert "interrupted: sending stopped" in err
    report = Path(re.search(r"partial report \(interrupted: .*\) in (\S+)", out).group(1))  # type: ignore[union-attr]
    got = read_records(report / "records.jsonl")
    assert 0 < len(got) < 40 and f"Ctrl-C after {len(got)} of 40 requests were sent" in out
    assert {r.status for r in got} <= {"ok", "aborted"} and any(r.status == "aborted" for r in got)
    assert "[interrupted]" in out.splitlines()[-1]


def test_without_a_cluster_to_watch_serve_says_where_it_looked(cluster: E2ECluster, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "user-state"))
    monkeypatch.delenv("TIDAL_STATE", raising=False)
    trace = burst_trace(tmp_path / "small.jsonl", 2, 0.2, 4)
    assert main(["bench", "serve", str(trace), "--url", cluster.base_url, "--no-live", "--no-plots",
                 "--no-probe"]) == 0
    err = capsys.readouterr().err
    assert "not recording worker memory or plan events: no Tidal cluster is running: looked in" in err
    assert str(tmp_path / ".tidal" / "run.json") in err and str(tmp_path / "user-state") in err
    assert list((tmp_path / "runs").glob("serve-*/records.jsonl"))  # the default --out, under the cwd
