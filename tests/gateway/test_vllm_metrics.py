"""vLLM-named metrics: the workers' engine gauges from their stats, the gateway's request histograms
with vLLM's buckets; read back with prometheus_client's own text parser."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway import vllm_metrics
from services.gateway.generation import Generation
from services.gateway.streaming import Metering
from services.gpu_worker.metrics import export_stats
from shared.events import InstanceStats, LayerRange, PoolBreakdown, SamplingParams, SubmitRequest, WorkerStats
from shared.events.common import Usage
from shared.events.stream import TokenChunk
from shared.metrics import REGISTRY


def samples(name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def stats(running: int, waiting: int, used: int) -> WorkerStats:
    inst = InstanceStats(instance_id="i-7", model="m-vllm", layers=LayerRange(start=0, end=2), running=running,
                         waiting=waiting, kv_blocks_used=used, kv_blocks_total=200)
    return WorkerStats(worker_id="w-vllm", seq=0, ts=0.0, device="cpu", state="ready",  # type: ignore[arg-type]
                       pool=PoolBreakdown(capacity_bytes=1 << 20), instances=[inst])


def test_worker_stats_are_vllms_engine_gauges() -> None:
    export_stats(stats(running=3, waiting=5, used=50))
    key = (("engine", "i-7"), ("model_name", "m-vllm"))
    assert samples("vllm:num_requests_running")[key] == 3
    assert samples("vllm:num_requests_waiting")[key] == 5
    assert samples("vllm:gpu_cache_usage_perc")[key] == 0.25
    export_stats(WorkerStats(worker_id="w-vllm", seq=1, ts=0.0, device="cpu", state="ready",  # type: ignore[arg-type]
                             pool=PoolBreakdown(capacity_bytes=1 << 20), instances=[]))
    assert key not in samples("vllm:num_requests_running")  # an unloaded instance leaves


def test_request_histograms_have_vllms_names_and_buckets() -> None:
    submit = SubmitRequest(request_id="r-1", model="m-hist", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                           arrival_ts=0.0)
    gen = Generation(None, [submit], prompt_groups=[0], timeout_s=1.0)  # type: ignore[arg-type]
    meter = Metering("/v1/completions", arrival=0.0, model="m-hist")
    for seq, final in ((0, False), (1, False), (2, True)):
        msg = TokenChunk(request_id="r-1", seq=seq, token_ids=[5], finish_reason="stop" if final else None,
                         usage=Usage(prompt_tokens=3, completion_tokens=3) if final else None)
        gen._accept(gen.choices[0], msg, [])
        meter.saw(msg, 0)
    meter.finished(gen)
    label = (("model_name", "m-hist"),)
    for name, buckets in (("vllm:time_to_first_token_seconds", vllm_metrics.TTFT_BUCKETS),
                          ("vllm:time_per_output_token_seconds", vllm_metrics.TPOT_BUCKETS),
                          ("vllm:e2e_request_latency_seconds", vllm_metrics.E2E_BUCKETS)):
        counts = samples(name + "_count")
        assert counts[label] == 1, name
        les = sorted(float(dict(k)["le"]) for k in samples(name + "_bucket") if dict(k)["model_name"] == "m-hist")
        assert les == [*buckets, float("inf")], name
    assert samples("vllm:generation_tokens_total")[label] == 3
    assert samples("vllm:prompt_tokens_total")[label] == 3
    assert samples("vllm:request_success_total")[(("finished_reason", "stop"), ("model_name", "m-hist"))] == 1
