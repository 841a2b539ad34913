"""`tidal bench serve` refuses a trace naming models the gateway does not serve, before sending
anything. A real gateway (nats-server, registry, gateway processes) serving `tok-model`."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from gateway.stack import ADAPTER, MODEL, GatewayStack
from loadgen.traces.io import write_trace
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord
from services.gpu_worker.engine.tokenizer import save_tokenizer, train_tokenizer
from tidal.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(512), tokenizer)
    running = GatewayStack(tmp_path_factory.mktemp("serve-refusal"), tokenizer, dispatcher=False).start()
    try:
        yield running
    finally:
        running.stop()


def completions_answered(stack: GatewayStack) -> float:
    text = httpx.get(stack.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('tidal_gateway_requests_total{route="/v1/completions"'))


def test_a_trace_of_unserved_models_is_refused_before_anything_is_sent(stack: GatewayStack, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    records = [TraceRecord(arrival_s=i * 0.1, model="model-0", prompt_tokens=8, output_tokens=4) for i in range(5)]
    path = write_trace(tmp_path / "t.jsonl", Trace(header=TraceHeader(
        params=PoissonParams(), num_records=len(records), duration_s=0.5), records=records))
    out = tmp_path / "report"
    code = main(["bench", "serve", str(path), "--url", stack.url, "--out", str(out), "--no-bus", "--no-live"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not serve: model-0 (5 requests)" in err
    assert f"It serves: {MODEL}, {ADAPTER}" in err and f"--model-map model-0={MODEL}" in err
    assert completions_answered(stack) == 0 and not out.exists()  # nothing sent, no report

    code = main(["bench", "serve", str(path), "--url", stack.url, "--model-map", "model-0", "--no-bus", "--no-live"])
    assert code == 2 and "expected OLD=NEW" in capsys.readouterr().err
