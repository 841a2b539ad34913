"""`tidal bench migrate`: live-migration downtime vs sequence length, KV mode vs token mode.

Real processes: nats-server, a registry and two gpu_workers (w0, w1) serving a generated
model with a long enough context. For each prompt length, a greedy request is assigned to
w0, decodes a few tokens, and is moved to w1 mid-decode with `MigrateOut(mode="kv")`, then
the same request again with `mode="tokens"` (the baseline, same run). Per run:

* stall — what the client sees: the arrival of w1's first chunk minus the arrival of w0's
  last one (one decode step is the floor; token mode adds the re-prefill on w1);
* stopped — the worker's `MigrationReport.downtime_s`: the source stopped the request ->
  the destination's engine holds it (KV: the whole pause but the next step; tokens: before
  the re-prefill);
* total time, KV bytes moved and data-plane stages (pre-copy + final stop).

Medians over `--repeats`. Both modes must give the same tokens (checked). The goal (issue 6,
Llumnix): KV-mode downtime flat in the sequence length. Writes a PNG of stall vs length in
the run's --out directory (default runs/migrate-<time>/); `--update-docs` also copies it to
docs/images/migrate_downtime.png.
The machine is shared: the load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.bus import Bus, BusSettings, Delivery
from shared.events import AssignAccepted, AssignReply, Assignment, SamplingParams, StreamError, TokenChunk
from shared.events.ctl import CtlDone, CtlReply, MigrateOut, MigrationReport
from shared.nats_server import NatsServer
from shared.subjects import request_out, worker_assign, worker_ctl
from tidal.bench.output import add_out_argument, out_dir, publish_plot

PLOT = "migrate_downtime.png"

CONFIG = """
[cluster]
data_dir = "data"

[registry]
heartbeat_interval = "200ms"
dead_after = "2s"

[[models]]
name = "long"
path = "{model}"
max_context = {context}
{workers}
[policies]
max_batch_size = 8
step_token_budget = 512
kv_block_tokens = 16
"""
WORKER = """
[[workers]]
id = "{id}"
device = "cpu"
memory = "{memory}"
models = ["long"]
"""


@dataclass
class Run:
    mode: str
    length: int
    report: MigrationReport
    stall_s: float
    step_s: float  # median gap between w0's chunks before the move (one decode step)
    tokens: list[int] = field(default_factory=list)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


class _Cluster:
    def __init__(self, root: Path, config: Path, threads: int) -> None:
        self.root, self.config, self.threads = root, config, threads
        self.nats: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> str:
        self.nats = NatsServer(store_dir=self.root / "nats").start()
        for name, extra in (("registry", []), ("w0", ["--worker-id", "w0"]), ("w1", ["--worker-id", "w1"])):
            service = "registry" if name == "registry" else "gpu_worker"
            argv = [sys.executable, "-m", f"services.{service}", "--nats", self.nats.url, "--config", str(self.config),
                    "--instance", f"bench-{name}", "--metrics-port", "-1", "--log-level", "info", *extra]
            if service == "gpu_worker":
                argv += ["--threads", str(self.threads)]
            with open(self.root / f"{name}.log", "ab") as log:
                self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self.nats.url

    async def wait_ready(self, bus: Bus, timeout: float = 180.0) -> None:
        from tidal.health_probe import gather_health

        deadline = time.monotonic() + timeout
        want = {f"bench-{n}" for n in ("w0", "w1")}
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; logs in {self.root}")
            replies = await gather_health(bus, "gpu_worker", timeout=0.5, expect=want)
            if all(r in replies and replies[r].state == "ready" for r in want):
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"workers not ready within {timeout}s; logs in {self.root}")

    def stop(self) -> None:
        for name in reversed(list(self.procs)):  # workers first: they tell the registry they stop
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.nats is not None:
            self.nats.stop()


WARMUP_PROMPT = 64
WARMUP_TOKENS = 400


async def _one(bus: Bus, rid: str, prompt: list[int], mode: str, args: argparse.Namespace, max_tokens: int = 0) -> Run:
    arrivals: list[tuple[float, TokenChunk]] = []
    errors: list[StreamError] = []
    done = asyncio.Event()

    async def on(msg: TokenChunk | StreamError, _ctx: Delivery) -> None:
        if isinstance(msg, StreamError):
            errors.append(msg)
        else:
            arrivals.append((time.perf_counter(), msg))
        if msg.final:
            done.set()

    sub = await bus.subscribe(request_out(rid), TokenChunk | StreamError, on)
    a = Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id="w0-long", model="long",
                   prompt_token_ids=prompt, arrival_ts=time.time(),
                   sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens or args.max_tokens, ignore_eos=True))
    accepted = await bus.request(worker_assign("w0"), a, AssignReply, timeout=30)
    assert isinstance(accepted, AssignAccepted), accepted
    while len(arrivals) < args.decode_before:
        await asyncio.sleep(0.001)
    reply = await bus.request(worker_ctl("w0"), MigrateOut(
        idempotency_key=f"out-{rid}", request_id=rid, destination="w1", destination_instance="w1-long", mode=mode,  # type: ignore[arg-type]
    ), CtlReply, timeout=120)
    if not isinstance(reply, CtlDone) or reply.migration is None:
        raise SystemExit(f"{rid}: migration failed: {reply}")
    await asyncio.wait_for(done.wait(), 300)
    await sub.drain()
    if errors:
        raise SystemExit(f"{rid}: stream error: {errors[0].message}")
    arrivals.sort(key=lambda x: x[1].seq)
    seqs = [c.seq for _, c in arrivals]
    if seqs != list(range(len(seqs))):
        raise SystemExit(f"{rid}: sequence numbers not consecutive: {seqs[:20]}...")
    src = [t for t, c in arrivals if c.worker_id == "w0"]
    dst = [t for t, c in arrivals if c.worker_id == "w1"]
    gaps = [b - a for a, b in zip(src, src[1:])]
    return Run(mode=mode, length=len(prompt), report=reply.migration, stall_s=dst[0] - src[-1],
               step_s=statistics.median(gaps) if gaps else 0.0, tokens=[t for _, c in arrivals for t in c.token_ids])


async def _measure(url: str, cluster: _Cluster, args: argparse.Namespace) -> list[Run]:
    bus = await Bus.connect(BusSettings(url=url), service="bench-migrate")
    runs: list[Run] = []
    try:
        await cluster.wait_ready(bus)
        rng = random.Random(7)
        # opens the UCX links and runs the first steps; long enough that its move ends before it does
        await _one(bus, "warm-up-kv", [rng.randrange(10, 1000) for _ in range(WARMUP_PROMPT)], "kv", args, WARMUP_TOKENS)
        for length in args.lengths:
            for rep in range(args.repeats):
                prompt = [rng.randrange(10, 1000) for _ in range(length)]
                pair = [await _one(bus, f"mig-{mode}-{length}-{rep}", prompt, mode, args) for mode in ("kv", "tokens")]
                if pair[0].tokens != pair[1].tokens:
                    raise SystemExit(f"length {length}: KV and token migration produced different tokens")
                runs.extend(pair)
                kv, tok = pair
                print(f"  {length:>5} tokens, run {rep}: stall kv {kv.stall_s * 1e3:7.1f} ms "
                      f"(stopped {kv.report.downtime_s * 1e3:6.1f} ms, {kv.report.stages} stages, "
                      f"{kv.report.kv_bytes / 2**20:6.1f} MiB) | tokens {tok.stall_s * 1e3:7.1f} ms", flush=True)
    finally:
        await bus.close()
    return runs


def _table(runs: list[Run]) -> list[dict[str, float]]:
    rows = []
    for length in sorted({r.length for r in runs}):
        row: dict[str, float] = {"length": length}
        for mode in ("kv", "tokens"):
            rs = [r for r in runs if r.length == length and r.mode == mode]
            row[f"{mode}_stall_ms"] = statistics.median(r.stall_s for r in rs) * 1e3
            row[f"{mode}_stopped_ms"] = statistics.median(r.report.downtime_s for r in rs) * 1e3
            row[f"{mode}_total_ms"] = statistics.median(r.report.total_s for r in rs) * 1e3
            row[f"{mode}_mib"] = statistics.median(r.report.kv_bytes for r in rs) / 2**20
            row[f"{mode}_stages"] = statistics.median(r.report.stages for r in rs)
            row[f"{mode}_step_ms"] = statistics.median(r.step_s for r in rs) * 1e3
            row[f"{mode}_stall_max_ms"] = max(r.stall_s for r in rs) * 1e3
        rows.append(row)
    return rows


def _plot(rows: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(x, [r["kv_stall_ms"] for r in rows], "o-", label="KV (pre-copy): client stall")
    ax.plot(x, [r["kv_stopped_ms"] for r in rows], "o--", label="KV: stopped on the workers")
    ax.plot(x, [r["tokens_stall_ms"] for r in rows], "s-", label="tokens (re-prefill): client stall")
    ax.plot(x, [r["kv_step_ms"] for r in rows], ":", color="grey", label="one decode step")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length at migration (tokens)")
    ax.set_ylabel("downtime (ms, median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine.checkpoint_gen import make_model

    started = time.time()
    args.lengths = sorted(int(x) for x in str(args.lengths).split(","))
    root = Path(args.dir or tempfile.mkdtemp(prefix="tidal-bench-migrate-"))
    root.mkdir(parents=True, exist_ok=True)
    # the context holds the warm-up's whole generation too: capped by a short context it ended mid-move (CI, busy box)
    context = max(max(args.lengths), WARMUP_PROMPT) + max(args.max_tokens, WARMUP_TOKENS) + 64
    model = make_model(root / "long", arch="llama", layers=args.layers, hidden=args.hidden, heads=args.heads,
                       kv_heads=args.kv_heads, vocab=1024, seed=1, max_position=max(2048, context))
    config = root / "cluster.toml"
    config.write_text(CONFIG.format(model=model, context=context,
                                    workers="".join(WORKER.format(id=w, memory=args.memory) for w in ("w0", "w1"))))
    kv_per_token = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 4
    print(f"# migrate: model {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads (fp32: "
          f"{kv_per_token / 1024:.0f} KiB of KV per token); 2 CPU workers ({args.threads} thread(s) each) over "
          f"loopback UCX; {args.repeats} repeats; migrate after {args.decode_before} chunks")
    print(f"# before: {_load()}")
    cluster = _Cluster(root, config, args.threads)
    try:
        url = cluster.start()
        runs = asyncio.run(_measure(url, cluster, args))
    finally:
        cluster.stop()
    if not args.dir:  # a temp dir of ours (logs kept only with --dir)
        shutil.rmtree(root, ignore_errors=True)
    rows = _table(runs)
    print(f"# after: {_load()}")
    print(f"{'length':>6} | {'KV stall':>8} {'(max)':>7} {'stopped':>7} {'total':>7} {'MiB':>6} {'stages':>6} | "
          f"{'tokens stall':>12} {'total':>7} | {'decode step':>11}  (ms; medians but (max))")
    for r in rows:
        print(f"{int(r['length']):>6} | {r['kv_stall_ms']:>8.1f} {r['kv_stall_max_ms']:>7.1f} {r['kv_stopped_ms']:>7.1f} "
              f"{r['kv_total_ms']:>7.1f} {r['kv_mib']:>6.1f} {int(r['kv_stages']):>6} | {r['tokens_stall_ms']:>12.1f} "
              f"{r['tokens_total_ms']:>7.1f} | {r['kv_step_ms']:>11.1f}")
    first, last = rows[0], rows[-1]
    if not args.no_plot:
        plot = out_dir(args, started) / PLOT
        _plot(rows, plot, f"live migration downtime vs length: 2 CPU workers, loopback UCX\n"
                          f"{time.strftime('%Y-%m-%d')}, {_load()}")
        print(f"# plot: {plot}")
        docs = publish_plot(args, plot)
        if docs is not None:
            print(f"# docs figure updated: {docs}")
    print(f"KV-mode stall {first['kv_stall_ms']:.1f} -> {last['kv_stall_ms']:.1f} ms from {int(first['length'])} to "
          f"{int(last['length'])} tokens (x{last['kv_stall_ms'] / first['kv_stall_ms']:.2f}); token mode "
          f"{first['tokens_stall_ms']:.1f} -> {last['tokens_stall_ms']:.1f} ms "
          f"(x{last['tokens_stall_ms'] / first['tokens_stall_ms']:.2f}); at {int(last['length'])} KV is "
          f"{last['tokens_stall_ms'] / last['kv_stall_ms']:.1f}x shorter")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("migrate", help="live migration downtime vs sequence length: KV pre-copy vs tokens")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096", help="prompt lengths (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens each request generates")
    parser.add_argument("--decode-before", type=int, default=8, help="chunks the client gets before the move")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--memory", default="1GiB", help="each worker's pool")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--dir", default="", help="where the model, config and logs go (default: a temp dir)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    add_out_argument(parser, "migrate", doc_image=PLOT)
    parser.set_defaults(func=run_bench)
