"""`tidal bench gateway`: N concurrent streams through gateway + NATS + dispatcher + worker vs
the same requests submitted to the engine in process — same model, same engine settings, same run.

Workload: `--streams` closed-loop clients, each sending `--rounds` streaming completions one
after another (token-id prompts of `--prompt-len`, greedy, exactly `--output-len` tokens).
Through the cluster, each client is an HTTP/1.1 keep-alive connection reading SSE; in
process, a finished request is replaced by the next one after the same step. Reported for
each: output tokens/s and median TTFT at that load, and unloaded TTFT (one request at a
time). The last line is the throughput ratio (goal >= 0.90 at 64 streams; added unloaded
TTFT goal <= 2 ms). The cluster runs on this machine: its processes share the cores.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from loadgen.runner.bench_cluster import BenchCluster
from tidal.bench.sse_client import BenchHTTPError, SSEConnection
from shared.nats_server import free_port

T = TypeVar("T")

CONFIG = """
[cluster]
data_dir = "{data}"

[gateway]
port = {port}

[dispatcher]
queue_bound = 4096

[[models]]
name = "bench"
path = "{model}"
max_context = {context}

[[workers]]
id = "bench-0"
device = "cpu"
memory = "{memory}"
models = ["bench"]
{worker_extra}
[policies]
max_batch_size = {batch}
step_token_budget = {budget}

[observability]
log_level = "warning"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="streams through gateway+NATS+dispatcher+worker vs the engine in process")
    p.add_argument("--model", help="checkpoint directory (default: generate the demo-llama model)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream, one after another")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--unloaded", type=int, default=10, help="sequential requests for the unloaded TTFT")
    p.add_argument("--threads", type=int, help="engine torch threads, both paths (default: the worker's default)")
    p.add_argument("--memory", default="1GiB", help="the worker's pool")
    p.add_argument("--stream-interval", help="the worker's stream_interval, e.g. 0 or 10ms (default: the config's)")
    p.add_argument("--idle-gap", type=float, default=4.0,
                   help="ms the in-process engine idles before each unloaded request, as the worker's engine does "
                        "between requests through the gateway (default: %(default)s; also measured back to back)")
    p.add_argument("--repeat", type=int, default=3, help="alternating repeats of both paths (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


@dataclass
class Result:
    seconds: float
    tokens: int
    ttfts: list[float]

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def ttft_ms(self) -> float:
        return statistics.median(self.ttfts) * 1000


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run the HTTP clients on uvloop (as the gateway runs): the client shares the cores it measures."""
    import uvloop

    return uvloop.run(coro)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)



def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


# --- through the cluster ------------------------------------------------------------------------
async def _http(port: int, streams: list[list[list[int]]], output_len: int) -> Result:
    ttfts: list[float] = []
    tokens = 0

    async def client(prompts: list[list[int]]) -> None:
        nonlocal tokens
        conn = SSEConnection("127.0.0.1", port)
        try:
            for prompt in prompts:
                t = await conn.post_stream("/v1/completions", {
                    "model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                })
                ttfts.append(t.ttft)
                tokens += t.completion_tokens
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(p) for p in streams))
    return Result(time.perf_counter() - start, tokens, ttfts)


async def _warm_up(port: int, streams: list[list[list[int]]], output_len: int, timeout_s: float = 60.0) -> None:
    """Until a request goes through (the dispatcher or gateway may not have seen the worker yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await _http(port, streams, output_len)
            return
        except BenchHTTPError as exc:
            # 503: no stats from the worker yet; 404: the model's registry record not seen yet
            if time.monotonic() > deadline or not any(f"HTTP {c}" in str(exc) for c in (503, 404)):
                raise
            await asyncio.sleep(0.5)


# --- in process -----------------------------------------------------------------------------------
def _in_process(engine: object, streams: list[list[list[int]]], output_len: int, idle_gap_s: float = 0.0) -> Result:
    """`idle_gap_s`: sleep that long before each next request (an engine idle between requests is
    slower to its first token: caches and the core go to other work meanwhile)."""
    from services.gpu_worker.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    eng = engine  # LLMEngine
    todo = {i: list(p) for i, p in enumerate(streams)}
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    owner: dict[str, int] = {}
    counter = 0

    def submit(stream: int, now: float) -> None:
        nonlocal counter
        if todo[stream]:
            rid = f"ip-{counter}"
            counter += 1
            eng.add_request(rid, todo[stream].pop(0), params)  # type: ignore[attr-defined]
            sent[rid], owner[rid] = now, stream

    start = time.perf_counter()
    for i in todo:
        submit(i, start)
    tokens = 0
    while eng.has_unfinished:  # type: ignore[attr-defined]
        outputs = eng.step()  # type: ignore[attr-defined]
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            tokens += len(out.new_token_ids)
            if out.finished:
                if idle_gap_s:
                    time.sleep(idle_gap_s)
                    now = time.perf_counter()
                submit(owner[out.request_id], now)
    return Result(time.perf_counter() - start, tokens, [first[r] - sent[r] for r in first])


def run(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine.checkpoint_gen import make_model
    from services.gpu_worker.engine.engine import LLMEngine
    from services.gpu_worker.loading import default_threads, engine_config
    from shared.config import parse_config

    tmp = tempfile.TemporaryDirectory(prefix="tidal-bench-gateway-")
    root = Path(tmp.name)
    model = args.model or str(make_model(root / "model", arch="llama", layers=4, hidden=128, heads=4, kv_heads=2,
                                         intermediate=352, vocab=2048, seed=1))
    context = args.prompt_len + args.output_len + 16
    port = free_port()
    text = CONFIG.format(data=root / "data", port=port, model=model, context=context, memory=args.memory,
                         batch=max(args.streams, 1), budget=max(2048, args.streams),
                         worker_extra=f'stream_interval = "{args.stream_interval}"\n' if args.stream_interval else "")
    cfg = parse_config(text, base_dir=root)
    worker = cfg.worker("bench-0")
    threads = args.threads or default_threads(cfg, worker)
    (root / "cluster.toml").write_text(text)
    engine = LLMEngine(engine_config(cfg, worker, cfg.model("bench"), int(worker.memory), threads))
    vocab = engine.runner.cfg.vocab_size
    streams = [_prompts(args.rounds, args.prompt_len, vocab, args.seed + i) for i in range(args.streams)]
    single = [_prompts(args.unloaded, args.prompt_len, vocab, args.seed + 10_000)]
    print(f"model: {engine.runner.cfg.architecture} {engine.runner.cfg.num_layers} layers, hidden "
          f"{engine.runner.cfg.hidden_size}, vocab {vocab}; engine threads {threads}; {args.streams} streams x "
          f"{args.rounds} requests, prompt {args.prompt_len}, output {args.output_len} tokens; "
          f"worker stream_interval {worker.stream_interval * 1000:g} ms")

    cluster = BenchCluster(root, root / "cluster.toml", worker_args=["--threads", str(threads)])
    http: dict[str, list[Result]] = {"single": [], "load": []}
    local: dict[str, list[Result]] = {"single": [], "load": [], "idle": []}
    cpu: dict[str, float] = {}
    try:
        cluster.start(gateway_url=f"http://127.0.0.1:{port}")
        run_loop(_warm_up(port, [p[:2] for p in single], args.output_len))
        _in_process(engine, [p[:2] for p in single], args.output_len)  # warm-up
        for _ in range(args.repeat):  # alternate the two paths so machine noise lands on both alike
            http["single"].append(run_loop(_http(port, single, args.output_len)))
            local["single"].append(_in_process(engine, single, args.output_len))
            local["idle"].append(_in_process(engine, single, args.output_len, args.idle_gap / 1000))
            before, own_before = cluster.cpu_seconds(), time.process_time()
            http["load"].append(run_loop(_http(port, streams, args.output_len)))
            after, own = cluster.cpu_seconds(), time.process_time() - own_before
            for name in after:
                cpu[name] = cpu.get(name, 0.0) + after[name] - before.get(name, 0.0)
            cpu["bench client"] = cpu.get("bench client", 0.0) + own
            own_before = time.process_time()
            local["load"].append(_in_process(engine, streams, args.output_len))
            cpu["in process"] = cpu.get("in process", 0.0) + time.process_time() - own_before
    except Exception:
        for name in ("gateway", "dispatcher", "gpu_worker"):
            print(f"--- {name} log (tail):\n{cluster.log_tail(name)}")
        raise
    finally:
        cluster.stop()
        tmp.cleanup()
    _report(args, http, local, cpu)
    return 0


def _median_result(results: list[Result]) -> Result:
    """The repeat with the median throughput (its TTFTs: all repeats' pooled)."""
    mid = sorted(results, key=lambda r: r.tps)[len(results) // 2]
    return Result(mid.seconds, mid.tokens, [t for r in results for t in r.ttfts])


def _report(args: argparse.Namespace, http: dict[str, list[Result]], local: dict[str, list[Result]],
            cpu: dict[str, float]) -> None:
    ip_load, ip_single = _median_result(local["load"]), _median_result(local["single"])
    ip_idle = _median_result(local["idle"])
    gw_load, gw_single = _median_result(http["load"]), _median_result(http["single"])
    n = args.streams
    print(f"(median of {args.repeat} alternating repeats; {_cores()} cores)")
    print(f"in process:      {ip_load.tps:8.0f} output tok/s, TTFT median {ip_load.ttft_ms:7.1f} ms at {n} streams; "
          f"unloaded TTFT {ip_single.ttft_ms:6.2f} ms ({ip_idle.ttft_ms:.2f} ms after {args.idle_gap:g} ms idle)")
    print(f"through gateway: {gw_load.tps:8.0f} output tok/s, TTFT median {gw_load.ttft_ms:7.1f} ms at {n} streams; "
          f"unloaded TTFT {gw_single.ttft_ms:6.2f} ms")
    tokens = sum(r.tokens for r in http["load"])
    ip_cpu = cpu.pop("in process", 0.0)
    shares = ", ".join(f"{name} {sec * 1000 / tokens:.3f}" for name, sec in sorted(cpu.items(), key=lambda kv: -kv[1]))
    print(f"CPU seconds per 1000 output tokens: in process {ip_cpu * 1000 / tokens:.3f}; through the gateway "
          f"{sum(cpu.values()) * 1000 / tokens:.3f} = {shares}")
    print(f"added TTFT (median): unloaded {gw_single.ttft_ms - ip_single.ttft_ms:+.2f} ms "
          f"({gw_single.ttft_ms - ip_idle.ttft_ms:+.2f} ms vs the engine after {args.idle_gap:g} ms idle), "
          f"at {n} streams {gw_load.ttft_ms - ip_load.ttft_ms:+.1f} ms")
    print(f"ratio gateway/in-process (output tokens/s at {n} streams): {gw_load.tps / ip_load.tps:.2f}")
