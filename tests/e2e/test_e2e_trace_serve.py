"""Long token-id prompts and traces against a live cluster (real processes, one worker).

A token-id prompt is bounded by max_prompt_tokens and the model's context, not by the 128
that bounds a list of prompts: 300 ids generate, through the official `openai` client.
`tidal trace` with the cluster's config names its default model, so `tidal bench serve`
runs it as it is; a trace made for other model names runs with `--model-map`.
"""
from __future__ import annotations

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
