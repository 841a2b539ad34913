"""vLLM's request metrics, with vLLM's names, labels and buckets, beside the gateway's own.

Dashboards and autoscaling rules written for vLLM (vLLM's Grafana dashboard, production-stack,
KEDA triggers on `vllm:*`) read these unchanged. `model_name` is the base model a request ran
on (a LoRA adapter's requests count under its base, as in vLLM). The engine-side gauges
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:gpu_cache_usage_perc`) are the
workers' (services/gpu_worker/metrics.py). One difference: `vllm:time_per_output_token_seconds`
is observed once per finished choice (its mean gap) rather than at every token.
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram

from shared.metrics import REGISTRY

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
LABELS = ["model_name"]

TTFT = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
                 buckets=TTFT_BUCKETS, registry=REGISTRY)
TPOT = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", LABELS,
                 buckets=TPOT_BUCKETS, registry=REGISTRY)
E2E = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
                buckets=E2E_BUCKETS, registry=REGISTRY)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=REGISTRY)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS,
                            registry=REGISTRY)
REQUEST_SUCCESS = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=REGISTRY)

__all__ = ["E2E", "GENERATION_TOKENS", "PROMPT_TOKENS", "REQUEST_SUCCESS", "TPOT", "TTFT"]
