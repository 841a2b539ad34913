"""`tidal repro caraserve --live`: the scheduler study (§7.5) small, on a local cluster, beside the simulator.

Real processes (`loadgen.runner.bench_cluster`): nats-server, registry, gateway, a dispatcher and
`workers` CPU gpu_workers, each serving one small generated model with every adapter resident
(the Cached backend, as the paper's testbed run, Fig. 20: the study isolates routing). The
same Poisson trace (`caraserve_live_trace.live_trace`) is sent through the gateway once per
policy; between policies only the dispatcher is restarted, with `[dispatcher] routing_policy`
set — the workers, their adapters and the gateway stay, so only the routing differs. Rank-aware
routes with the LoRA profile measured at start on this checkpoint (`tidal profile lora`, or
`--profile`) and an SLO of `slo_factor` x that model's unloaded step; attainment is judged
against `slo_factor` x the HF-PEFT level, the time per token of one request alone without an
adapter, measured on the live cluster before the runs.

The simulator then replays the same records with the same policies on a profile of the same
measured model (`sim_cost_profile`); the difference of mean TPOT is what the model leaves out.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadgen.repro.caraserve_live_trace import (
    MODEL, LiveSpec, PolicyFigures, adapter_ranks, live_headline, live_trace, policy_figures, sim_cost_profile,
)
from loadgen.runner.runner import LoadRunner, RunnerConfig
from loadgen.sim.lora_worker import lora_worker_factory
from loadgen.sim.simulator import Simulator
from loadgen.traces.schema import Trace, TraceRecord
from shared.lora_profile_file import load_lora_profile
from shared.nats_server import free_port
from shared.policy.lora_perf_model import LoraPerfProfile, encode_profile
from shared.policy.lora_routing import RoutingOptions
from shared.policy.routing_policies import make_policy
from loadgen.runner.bench_cluster import BenchCluster

STEP_TOKEN_BUDGET = 512
MAX_CONTEXT = 512
CONFIG = """
[cluster]
data_dir = "{data}"

[gateway]
port = {port}

[dispatcher]
queue_bound = 4096
routing_policy = "{policy}"
lora_profile = "{profile}"

[planner]
enabled = false

[[models]]
name = "{model}"
path = "{model_dir}"
max_context = {max_context}
{adapters}
{workers}
[policies]
lora_kernel = "{kernel}"
cpu_lora_assist = false
max_batch_size = {max_batch}
step_token_budget = {budget}

[slo]
tpot = "{slo}"

[observability]
log_level = "warning"
"""
WORKER = """
[[workers]]
id = "cara-{i}"
device = "cpu"
memory = "1GiB"
models = ["{model}"]
adapters = {resident}
cpu_lora_processes = 0
stream_interval = "0s"
"""


def make_assets(root: Path, spec: LiveSpec) -> tuple[Path, dict[str, tuple[int, Path]]]:
    """The checkpoint `tidal profile lora` generates by default (2 layers, hidden 512) and the adapters."""
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    model = make_model(root / "model", layers=2, hidden=512, heads=8, kv_heads=4, seed=spec.seed)
    out = {}
    for j, (name, rank) in enumerate(adapter_ranks(spec).items()):
        out[name] = (rank, make_lora(root / name, model, rank=rank, seed=spec.seed + 1 + j))
    return model, out


def config_text(spec: LiveSpec, root: Path, port: int, model_dir: Path, adapters: dict[str, tuple[int, Path]],
                policy: str, profile: Path) -> str:
    """The cluster's config for one policy. Rank-aware's SLO is `slo_factor` x the profile's unloaded
    step ("k x"), on the scale of the model it routes with; attainment is judged on the live level."""
    blocks = "".join(f'\n[[adapters]]\nname = "{n}"\nbase = "{MODEL}"\npath = "{p}"\nrank = {r}\n'
                     f'targets = ["q_proj", "k_proj", "v_proj", "o_proj"]\n' for n, (r, p) in adapters.items())
    workers = "".join(WORKER.format(i=i, model=MODEL, resident=json.dumps(list(adapters))) for i in range(spec.workers))
    return CONFIG.format(data=root / "data", port=port, policy=policy.replace("-", "_"), profile=profile, model=MODEL,
                         model_dir=model_dir, max_context=MAX_CONTEXT, adapters=blocks, workers=workers,
                         kernel=spec.kernel, max_batch=spec.max_batch, budget=STEP_TOKEN_BUDGET,
                         slo=f"{spec.slo_factor:g}x")


class LoraCluster(BenchCluster):
    """BenchCluster with several workers, and a dispatcher that can be restarted on another config."""

    def __init__(self, root: Path, config: Path, workers: int) -> None:
        super().__init__(root, config)
        self.worker_ids = [f"cara-{i}" for i in range(workers)]

    def _spawn(self, key: str, service: str, config: Path, extra: list[str]) -> None:
        assert self.nats is not None
        argv = [sys.executable, "-m", f"services.{service}", "--nats", self.nats.url, "--config", str(config),
                "--instance", f"cara-{key}", "--metrics-port", "-1", "--log-level", "warning", *extra]
        with open(self.root / "logs" / f"{key}.log", "ab") as log:
            self.procs[key] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def start(self, *, gateway_url: str, timeout_s: float = 300.0) -> None:
        from shared.nats_server import NatsServer

        self.nats = NatsServer(store_dir=self.root / "nats").start()
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        for name in ("registry", "dispatcher", "gateway"):
            self._spawn(name, name, self.config, [])
        for wid in self.worker_ids:  # one torch thread each: the host has few cores
            self._spawn(wid, "gpu_worker", self.config, ["--worker-id", wid, "--threads", "1"])
        wait_serving(gateway_url, self, timeout_s)

    def restart_dispatcher(self, config: Path) -> None:
        proc = self.procs.pop("dispatcher")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._spawn("dispatcher", "dispatcher", config, [])


def wait_serving(url: str, cluster: LoraCluster, timeout_s: float) -> None:
    """Until a base-model request succeeds (the dispatcher has every worker's stats)."""
    deadline = time.monotonic() + timeout_s
    body = json.dumps({"model": MODEL, "prompt": [16, 17, 18], "max_tokens": 2, "ignore_eos": True}).encode()
    ready = 0
    while ready < len(cluster.worker_ids) + 1:  # a few in a row: every worker warm, not just the first
        try:
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                ready += resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            ready = 0
            dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{cluster.log_tail(n)}" for n in (dead or list(cluster.procs)))
                raise RuntimeError(f"cluster not serving ({'exited: ' + ', '.join(dead) if dead else 'timeout'}):\n{tails}")
            time.sleep(0.3)


def drive(url: str, records: list[TraceRecord], seed: int) -> list:
    runner = LoadRunner(records, RunnerConfig(url=url, seed=seed, request_timeout_s=120.0))
    return asyncio.run(runner.run()).records


def warm_up(url: str, spec: LiveSpec, adapters: list[str]) -> None:
    """Every adapter a few times on every worker before anything is timed: a policy run first
    must not pay the engine's first-use costs for the others."""
    per = 2 * spec.workers
    records = [TraceRecord(arrival_s=0.02 * j, model=MODEL, adapter=adapters[j % len(adapters)],
                           prompt_tokens=spec.prompt[0], output_tokens=4, request_id=f"warm-{j}")
               for j in range(per * len(adapters))]
    drive(url, records, spec.seed)


def hf_peft_level(url: str, spec: LiveSpec, n: int = 4) -> tuple[float, float]:
    """(median TPOT, median TTFT) of base-model requests alone (spaced so that none overlap)."""
    output = sum(spec.output) // 2
    gap = 0.5 + output * 0.05
    records = [TraceRecord(arrival_s=j * gap, model=MODEL, prompt_tokens=sum(spec.prompt) // 2, output_tokens=output,
                           request_id=f"peft-{j}") for j in range(n)]
    done = [r for r in drive(url, records, spec.seed) if r.status == "ok" and r.first_token_s is not None]
    if not done:
        raise RuntimeError("no base-model request finished: cannot measure the HF-PEFT level")
    return (float(np.median([(r.finish_s - r.first_token_s) / max(r.output_tokens - 1, 1) for r in done])),
            float(np.median([r.first_token_s - r.arrival_s for r in done])))


def simulate(spec: LiveSpec, trace: Trace, lora: LoraPerfProfile, overhead_s: float) -> tuple[float, dict]:
    """Each policy on the same trace in the simulator: (its SLO, figures per policy)."""
    model = lora.model(spec.kernel)  # type: ignore[arg-type]
    slo_s = spec.slo_factor * model.decode_s([0])  # the HF-PEFT level there: one request, no adapter
    profile = sim_cost_profile(spec, step_token_budget=STEP_TOKEN_BUDGET, max_model_len=MAX_CONTEXT,
                               request_overhead_s=overhead_s)
    ranks = {a.name: a.rank for a in trace.header.adapters}
    out = {}
    for policy in spec.policies:
        options = RoutingOptions(profile=lora, kernel=spec.kernel, tpot_slo_s=slo_s)  # type: ignore[arg-type]
        sim = Simulator(trace, profile, spec.workers, make_policy(policy, spec.seed, options),
                        make_worker=lora_worker_factory(model, ranks))
        out[policy] = policy_figures(policy, sim.run().records, slo_s)
    return slo_s, out


@dataclass
class LiveRun:
    spec: LiveSpec
    trace: Trace
    profile_path: Path
    profile_lines: list[str]
    slo_s: float
    peft_tpot_s: float
    sim_slo_s: float
    live: dict[str, PolicyFigures] = field(default_factory=dict)
    sim: dict[str, PolicyFigures] = field(default_factory=dict)
    wall_s: float = 0.0


def run_live(spec: LiveSpec, out: Path, *, profile: Path | None = None,
             progress: Callable[[str], None] = print) -> LiveRun:
    started = time.perf_counter()
    out = out.resolve()  # the config's paths are read relative to the config file's directory
    out.mkdir(parents=True, exist_ok=True)
    model_dir, adapters = make_assets(out / "assets", spec)
    trace = live_trace(spec)
    if profile is None:  # measured before the cluster starts: nothing else competes for the cores
        from loadgen.profiler.lora import LoraSweep, profile_lora

        sweep = LoraSweep(kernels=(spec.kernel,), ranks=spec.ranks, batches=(1, 4, 8, 16),  # type: ignore[arg-type]
                          prompts=(16, 64), steps=5, repeats=3, model_dir=str(model_dir), fastest=True)
        for _ in range(3):  # a host busy with other work can give a fit whose unloaded step is <= 0: again
            lora, lines = profile_lora(sweep, name="caraserve-live")
            if lora.model(spec.kernel).decode_s([0]) > 0:  # type: ignore[arg-type]
                break
            progress(f"profile: unloaded decode step <= 0 ({lines[1]}); measuring again")
        profile = out / "profile-lora.json"
        profile.write_bytes(encode_profile(lora))
    else:
        lora, lines = load_lora_profile(profile), [f"loaded from {profile}"]
        lora.model(spec.kernel)  # type: ignore[arg-type]  # refuse a profile without the kernel before starting
    for line in lines:
        progress(f"profile: {line}")
    progress(f"trace: {len(trace.records)} requests over {spec.adapters} adapters (ranks "
             f"{'/'.join(map(str, spec.ranks))}) at {spec.rate:g} RPS for {spec.duration_s:g} s; {spec.workers} workers")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def write_config(policy: str) -> Path:
        path = out / f"cluster-{policy}.toml"
        path.write_text(config_text(spec, out, port, model_dir, adapters, policy, profile))
        return path

    cluster = LoraCluster(out, write_config("least-load"), spec.workers)
    try:
        cluster.start(gateway_url=url)
        warm_up(url, spec, list(adapters))
        peft_tpot, peft_ttft = hf_peft_level(url, spec)
        run = LiveRun(spec=spec, trace=trace, profile_path=profile, profile_lines=lines,
                      slo_s=spec.slo_factor * peft_tpot, peft_tpot_s=peft_tpot, sim_slo_s=0.0)
        progress(f"HF-PEFT level (one request alone, no adapter): TPOT {peft_tpot * 1e3:.2f} ms, TTFT "
                 f"{peft_ttft * 1e3:.1f} ms; SLO {run.slo_s * 1e3:.2f} ms per token")
        for policy in spec.policies:
            cluster.restart_dispatcher(write_config(policy))
            wait_serving(url, cluster, 120.0)
            records = drive(url, trace.records, spec.seed)
            res = run.live[policy] = policy_figures(policy, records, run.slo_s)
            progress(f"live {policy:10s}: SLO attainment {res.slo_attainment:.3f}, mean TPOT "
                     f"{res.tpot_mean_s * 1e3:.2f} ms, p99 {res.tpot_p99_s * 1e3:.2f} ms ({res.ok}/{res.requests} ok)")
    finally:
        cluster.stop()
    # the sim's per-request overhead: the live TTFT alone beyond the modelled prefill
    overhead = max(0.0, peft_ttft - lora.model(spec.kernel).prefill_s([(sum(spec.prompt) // 2, 0)]))  # type: ignore[arg-type]
    run.sim_slo_s, run.sim = simulate(spec, trace, lora, overhead)
    for policy, res in run.sim.items():
        progress(f"sim  {policy:10s}: SLO attainment {res.slo_attainment:.3f}, mean TPOT "
                 f"{res.tpot_mean_s * 1e3:.2f} ms (SLO {run.sim_slo_s * 1e3:.2f} ms)")
    run.wall_s = time.perf_counter() - started
    return run


def write_live_report(out: Path, run: LiveRun, command: str) -> Path:
    head = live_headline(run.live, run.sim)
    rows = []
    for policy in run.spec.policies:
        lv, sm = run.live[policy], run.sim[policy]
        rows.append(f"| {policy} | {lv.slo_attainment:.3f} | {lv.tpot_mean_s * 1e3:.2f} | {lv.tpot_p99_s * 1e3:.2f} | "
                    f"{lv.ok}/{lv.requests} | {sm.slo_attainment:.3f} | {sm.tpot_mean_s * 1e3:.2f} | "
                    f"{sm.tpot_mean_s / lv.tpot_mean_s - 1:+.0%} |")
    spec = run.spec
    text = "\n".join([
        "# CaraServe §7.5 live (small): rank-aware vs MostIdle / Random / FirstFit", "",
        f"Command: `{command}` ({run.wall_s:.0f} s). {spec.workers} CPU workers, {spec.adapters} adapters "
        f"(ranks {'/'.join(map(str, spec.ranks))}, all resident: Cached), {len(run.trace.records)} requests at "
        f"{spec.rate:g} RPS, {spec.kernel} kernel. SLO: {spec.slo_factor}x the HF-PEFT level "
        f"({run.peft_tpot_s * 1e3:.2f} ms live alone) = {run.slo_s * 1e3:.2f} ms per token live, "
        f"{run.sim_slo_s * 1e3:.2f} ms in the simulator (the model's unloaded step). Profile: {run.profile_path}.", "",
        "| policy | live SLO attainment | live mean TPOT ms | live p99 TPOT ms | ok | sim SLO attainment | "
        "sim mean TPOT ms | sim vs live |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        "Profile fit:", "", *[f"- {line}" for line in run.profile_lines], "", head.line(), ""])
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({
        "line": head.line(), "slo_s": run.slo_s, "sim_slo_s": run.sim_slo_s,
        "live": {p: _asdict(r) for p, r in run.live.items()}, "sim": {p: _asdict(r) for p, r in run.sim.items()},
    }, indent=1))
    return out / "report.md"


def _asdict(res: PolicyFigures) -> dict:
    import msgspec

    return msgspec.to_builtins(res)



__all__ = ["LiveRun", "LoraCluster", "config_text", "run_live", "simulate", "write_live_report"]
