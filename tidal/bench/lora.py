"""`tidal bench lora`: cold LoRA adapters — Cached vs OnDemand vs S-LoRA-like vs CPU-assisted (CaraServe §7.2).

One Poisson trace over many adapters (ranks 8/16/32/64 on q/k/v, made with the make-lora helper for
a small generated model): most requests ask for an adapter not used before (cold, as in the paper's
synthetic workload, where every request is), `--reuse` of them for one used earlier in the round
(warm). One local cluster (real processes) with one CPU worker per mode (lora_cluster.py); all modes
run the same LoRA kernel (`--kernel`, default segmented, Tidal's default) and differ only in adapter
management. The trace runs in `--rounds` rounds, each round every mode once in a rotating order, the
same requests and seeds; each round uses fresh adapter names, so cold requests are cold again.

Loads are paced (`lora_load_bandwidth`): derived at start so that a rank-64 load costs the share of a
typical prefill it costs in the paper (lora_stats.py has the published numbers); `--load-bandwidth`
overrides. Reports per mode the median over rounds (with min–max) of each round's median TTFT / TPOT /
E2E and of each one's overhead against cached, for all, cold and warm requests (paired: the same
requests under cached); medians, because a shared machine's bursts swamp means (results.json has
both). The last line, from the cold requests' TTFT:
`bench lora: ttft_overhead_cpu_assist=NN% ttft_overhead_ondemand=NN% ttft_overhead_slora=NN%`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path

from tidal.bench.lora_cluster import MODES, LoRACluster, adapter_name, config_text, model_name, warm_adapter
from tidal.bench.lora_stats import (PAPER_LOAD_OVER_PREFILL, PAPER_RANK64_LOAD_S, PAPER_TYPICAL_PREFILL_S,
                                    TraceRequest, adapter_slots, make_trace, mode_stats, paced_bandwidth,
                                    round_overheads, spread, summary_line)
from tidal.bench.output import add_out_argument, out_dir

RANKS = (8, 16, 32, 64)
WARMUPS = 3  # warm-up adapters per mode: the first cold requests also start the CPU helpers
# S-LoRA's unified pool: weights and workspace, the KV of a few of the longest requests and a few rank-64
# adapters; adapters and KV compete for the rest, LRU evicts adapters (a reused one may be cold again)
SLORA_KV_REQUESTS = 4
SLORA_ADAPTER_ROOM = 4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="cold adapters: Cached vs OnDemand vs S-LoRA-like vs CPU-assisted (CaraServe)")
    add_out_argument(p, "lora")
    p.add_argument("--requests", type=int, default=8, help="requests per round")
    p.add_argument("--rps", type=float, default=2.0, help="Poisson arrival rate")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--reuse", type=float, default=0.25, help="share of requests for an adapter used earlier (warm)")
    p.add_argument("--rounds", type=int, default=8, help="rounds; each runs every mode once, rotating the order")
    p.add_argument("--kernel", choices=("segmented", "padded"), default="segmented", help="LoRA kernel of every mode")
    p.add_argument("--load-bandwidth", help='paced adapter load rate, e.g. "200MB/s" (default: derived, see docs)')
    p.add_argument("--processes", type=int, default=2, help="CPU LoRA processes (cpu_assist)")
    p.add_argument("--threads", type=int, default=1, help="each worker's engine torch threads")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def make_assets(root: Path, slots: int, seed: int) -> tuple[Path, list[tuple[int, Path]], Path]:
    """The model, one adapter per slot (ranks cycling 8..64) and a rank-64 one for calibration."""
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    # hidden 512: a typical prefill (~50 ms on one core) well above the serving stack's own TTFT share
    model = make_model(root / "model", arch="llama", layers=4, hidden=512, heads=8, kv_heads=2, intermediate=1408,
                       vocab=2048, seed=seed)
    adapters = [(RANKS[i % len(RANKS)], root / f"lora-{i:03d}") for i in range(slots)]
    for i, (rank, path) in enumerate(adapters):
        make_lora(path, model, rank=rank, targets=["q", "k", "v"], seed=seed + 1 + i)
    rank64 = make_lora(root / "lora-calibrate", model, rank=64, targets=["q", "k", "v"], seed=seed)
    return model, adapters, rank64


async def _post(port: int, body: dict) -> dict[str, float]:
    from tidal.bench.sse_client import SSEConnection

    conn = SSEConnection("127.0.0.1", port)
    try:
        t = await conn.post_stream("/v1/completions", {**body, "temperature": 0, "ignore_eos": True, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    finally:
        await conn.close()
    tokens = max(t.completion_tokens, 1)
    return {"ttft_s": t.ttft, "tpot_s": (t.done - t.first_token) / max(tokens - 1, 1), "e2e_s": t.done - t.sent}


async def _warm_up(port: int, modes: list[str], prompt: list[int]) -> None:
    """Until each worker serves (its first stats reach the dispatcher), then its warm-up adapters:
    lazy initialisation, the first loads, the CPU helpers' start."""
    from tidal.bench.sse_client import BenchHTTPError

    for mode in modes:
        deadline, done = time.monotonic() + 180, 0
        while done < 2:
            try:
                await _post(port, {"model": model_name(mode), "prompt": prompt, "max_tokens": 2})
                done += 1
            except BenchHTTPError:  # 503 no_capacity: the worker's first stats are not in yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    for j in range(WARMUPS):
        for mode in modes:
            await _post(port, {"model": f"{warm_adapter(mode)}-{j}", "prompt": prompt, "max_tokens": 2})
        await asyncio.sleep(2.0)


async def _round(port: int, mode: str, rnd: int, trace: list[TraceRequest], output_len: int) -> list[dict]:
    start = time.perf_counter()

    async def one(i: int, req: TraceRequest) -> dict:
        await asyncio.sleep(max(0.0, start + req.at_s - time.perf_counter()))
        m = await _post(port, {"model": adapter_name(mode, rnd, req.slot), "prompt": req.prompt,
                               "max_tokens": output_len})
        return {"request": i, "slot": req.slot, "rank": RANKS[req.slot % len(RANKS)], "cold": req.cold,
                "prompt": len(req.prompt), **m}

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(trace))))


async def _drive(port: int, modes: list[str], trace: list[TraceRequest], args: argparse.Namespace) -> list[dict]:
    await _warm_up(port, modes, trace[0].prompt)
    rounds = []
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        rec = {}
        for mode in order:
            rec[mode] = await _round(port, mode, rnd, trace, args.output_len)
            await asyncio.sleep(0.5)  # the last streams' tails, the loader's queue drain
        rounds.append(rec)
        print(f"  round {rnd + 1}/{args.rounds} ({' '.join(order)}): cold-request median TTFT "
              + "  ".join(f"{m} {statistics.median(r['ttft_s'] for r in rec[m] if r['cold']) * 1000:.0f} ms" for m in modes),
              flush=True)
    return rounds


def _fmt(values: list[float], scale: float, unit: str) -> str:
    if not values:
        return "n/a"
    med, lo, hi = spread(values)
    sign = "+" if unit == "%" else ""
    return f"{med * scale:{sign}.0f}{unit} [{lo * scale:{sign}.0f}..{hi * scale:{sign}.0f}]"


def _report(rounds: list[dict], modes: list[str]) -> dict:
    over = round_overheads(rounds, modes)
    print("median over rounds [min..max] of each round's median (overheads: of the same requests under cached); "
          "cold = the round's first request for an adapter")
    for which in ("cold", "warm", "all"):
        print(f"  {which} requests:")
        for mode in modes:
            ttft = mode_stats(rounds, mode, "ttft_s", which)
            if not ttft:
                continue
            tpot, e2e = (mode_stats(rounds, mode, k, which) for k in ("tpot_s", "e2e_s"))
            line = (f"    {mode:<10} TTFT {_fmt(ttft, 1000, ' ms'):<22} TPOT {_fmt(tpot, 1000, ' ms'):<20}"
                    f" E2E {_fmt(e2e, 1000, ' ms'):<22}")
            if mode != "cached":
                o = over[mode]
                ttft_o, tpot_o, e2e_o = (_fmt(o.get(f"{k}_{which}", []), 100, "%") for k in ("ttft_s", "tpot_s", "e2e_s"))
                line += f" vs cached: TTFT {ttft_o}  TPOT {tpot_o}  E2E {e2e_o}"
            print(line)
    return over


def run(args: argparse.Namespace) -> int:
    from shared.config_units import Bandwidth
    from tidal.bench.lora_calibrate import calibrate

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or "cached" not in modes:
        raise SystemExit(f"--modes: {bad or 'cached is missing'}; choose from {', '.join(MODES)} (cached is the baseline)")
    if args.rounds < 1 or args.requests < 1:
        raise SystemExit(f"--rounds and --requests must be >= 1, got {args.rounds}, {args.requests}")
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    trace = make_trace(args.requests, args.rps, tuple(args.prompt_len), 2048, args.reuse, args.seed)
    model, adapters, rank64 = make_assets(out / "assets", adapter_slots(trace), args.seed)
    typical = round(sum(args.prompt_len) / 2)
    cal = calibrate(model, rank64, prompt_len=typical, kernel=args.kernel, threads=args.threads)
    derived = paced_bandwidth(cal.rank64_bytes, cal.prefill_s)
    bandwidth = float(Bandwidth.parse(args.load_bandwidth)) if args.load_bandwidth else derived
    cold = sum(r.cold for r in trace)
    print(f"lora bench: {args.requests} requests at {args.rps:g} RPS x {args.rounds} rounds ({cold} cold, "
          f"{args.requests - cold} warm), ranks {'/'.join(map(str, RANKS))} on q/k/v, output {args.output_len} "
          f"tokens, {args.kernel} kernel in every mode")
    print(f"load pacing: prefill of a {typical}-token prompt here {cal.prefill_s * 1000:.1f} ms (fastest of 9, median "
          f"{cal.prefill_median_s * 1000:.1f} ms; rank-64 adapter resident); paper: rank-64 load "
          f"{PAPER_RANK64_LOAD_S * 1000:.1f} ms / prefill {PAPER_TYPICAL_PREFILL_S * 1000:.0f} ms"
          f" = {PAPER_LOAD_OVER_PREFILL:.2f} -> a rank-64 adapter ({cal.rank64_bytes / 1e6:.2f} MB) loads in "
          f"{cal.rank64_bytes / derived * 1000:.1f} ms: lora_load_bandwidth = {derived / 1e6:.1f} MB/s (derived)"
          + (f"; --load-bandwidth {args.load_bandwidth} used instead ({cal.rank64_bytes / bandwidth * 1000:.1f} ms)"
             if args.load_bandwidth else ""), flush=True)
    kv_tokens = SLORA_KV_REQUESTS * (args.prompt_len[1] + args.output_len + 16)  # KV of a few longest requests
    memory = {m: 1 << 30 for m in modes}
    memory["slora"] = cal.fixed_bytes + kv_tokens * cal.kv_bytes_per_token + SLORA_ADAPTER_ROOM * cal.rank64_bytes
    port = _free_port()
    root = out / "cluster"
    root.mkdir(exist_ok=True)
    warm = [(RANKS[-1], rank64)] * WARMUPS
    (root / "cluster.toml").write_text(config_text(
        data=root / "data", port=port, model=model, adapters=adapters, rounds=args.rounds, modes=modes,
        kernel=args.kernel, bandwidth=bandwidth, processes=args.processes, memory=memory, warmups=warm))
    cluster = LoRACluster(root, root / "cluster.toml", modes, args.threads)
    try:
        cluster.start(f"http://127.0.0.1:{port}")
        rounds = asyncio.run(_drive(port, modes, trace, args))
    except Exception:
        for m in modes:
            print(f"--- worker-{m} log (tail):\n{cluster.log_tail(f'worker-{m}')}")
        raise
    finally:
        cluster.stop()
    over = _report(rounds, modes)
    (out / "results.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "func"}, "prefill_s": cal.prefill_s,
        "prefill_median_s": cal.prefill_median_s,
        "rank64_bytes": cal.rank64_bytes, "bandwidth": bandwidth, "derived_bandwidth": derived, "memory": memory,
        "overheads": over, "overheads_of_means": round_overheads(rounds, modes, "mean"), "rounds": rounds}, indent=1))
    print(f"(files in {out}; paper, Llama2-7B on an A10, every request cold: CPU-assisted +22% TTFT, "
          f"OnDemand/S-LoRA +412%/+451%)")
    print(summary_line(over))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
