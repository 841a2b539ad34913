"""`tidal bench lora`: CaraServe's cold start (§7.2, Fig. 10/11) — Cached, OnDemand, S-LoRA, our
asynchronous load, and CPU-assisted prefill — on one engine per mode in this process.

Workloads by name (`--workload`, lora_stats.WORKLOADS): the paper's single-server ones, their rate
scaled to this machine's capacity (as many arrivals per typical prefill as 9 RPS on the A10; the
prefill is timed here first), or `--rate`. Default `synthetic-r64`: Poisson, rank 64 on q/k/v, every
request for an adapter not used before (cold). `--ranks`, `--cold-fraction`, `--targets` override.
The same trace runs in `--rounds` rounds, every mode once per round in a rotating order, with fresh
adapter names each round (registered before the round: CaraServe's adapters are in host memory
before their requests come; registration is not the request path).

Kernels (lora_drive.py): ondemand on BGMV (padded), slora on MBGMV (segmented), the others on
`--kernel`; each mode against the Cached on its kernel, each kernel's arms at the paper's rate and
load share scaled by its own Cached prefill (BGMV gathers a padded A and B per token: on a CPU it
costs several segmented prefills, so its trace is stretched by the measured ratio).

Loads: on a CPU engine a memory copy paced so that a rank-64 load costs the paper's share of a
typical prefill (lora_stats.py); on CUDA the real host-to-device copy, unpaced. CPU LoRA: the CPU
arms run once per `--cpu-ratio` (helpers paced so a typical prompt's helper calls cost that share of
its prefill; 'native': unpaced). Cores: the CPU helpers get cores of their own where there are at
least two (half, at most `--processes`), the engines (this process) the rest; the run says how many
each side had. The auto arms print what the engine's rule chose and the T_cpu, X, P it measured.

Last line, from the paper's selection (all-cold workloads: the cold requests; MAF-like: all), the
mean TTFT overhead against Cached per round (the paper's "on average"), median [min..max] over
rounds, the CPU arms at the first ratio, and the rule's choices there:
`bench lora: ttft_overhead_cpu_assist=NN%[lo..hi] ttft_overhead_async=... ttft_overhead_auto=...
ttft_overhead_ondemand=... ttft_overhead_slora=... rounds=N cpu_ratio=R auto_choices=cpu_assist:N,async:N,inline:N`
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from tidal.bench.lora_drive import (ASSISTED, CACHED, MODES, CoreSplit, ModeEngine, base_mode, baseline_of, drive,
                                    kernel_of, make_engine, pin_engine, register_round, split_cores, usable_cores)
from tidal.bench.lora_report import print_choices, print_report, rule_view
from tidal.bench.lora_stats import (CPU_RATIOS, PAPER_LOAD_OVER_PREFILL, PAPER_RANK64_LOAD_S, PAPER_TYPICAL_PREFILL_S,
                                    WORKLOADS, cpu_pace, make_trace, paced_bandwidth, round_overheads, scaled_rate,
                                    summary_line)
from tidal.bench.output import add_out_argument, out_dir, run_alone

WARMUPS = 2  # warm-up requests per mode (lazy initialisation, the first loads, the helpers' first calls)
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="cold adapters: Cached vs OnDemand vs S-LoRA vs async vs CPU-assisted (CaraServe)")
    add_out_argument(p, "lora")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="synthetic-r64",
                   help="the paper's workload (rate scaled to this machine; default: all cold, rank 64)")
    p.add_argument("--ranks", help="comma-separated adapter ranks (default: the workload's)")
    p.add_argument("--rate", type=float, help="arrivals per second here (default: the workload's, scaled)")
    p.add_argument("--cold-fraction", type=float,
                   help="share of requests for an adapter not used before (synthetic workloads; default 1)")
    p.add_argument("--targets", default="q,k,v", help="projections the adapters adapt (default q,k,v: the paper's)")
    p.add_argument("--requests", type=int, default=24, help="requests per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs every mode once, rotating the order")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kernel", choices=("segmented", "padded"), default="segmented",
                   help="LoRA kernel of cached, async and the CPU arms (ondemand runs BGMV = padded, slora MBGMV = "
                        "segmented, each against a Cached on its kernel)")
    p.add_argument("--cpu-ratio", default=",".join(map(str, CPU_RATIOS)),
                   help="comma-separated CPU-LoRA-to-prefill ratios of a typical prompt the CPU arms run at (helpers "
                        "paced; 'native': unpaced); default the paper server's bf16 and fp32 estimates (lora_stats.py)")
    p.add_argument("--load-bandwidth", help='adapter load rate, e.g. "200MB/s" (default: derived on CPU, unpaced on CUDA)')
    p.add_argument("--pageable", action="store_true",
                   help="CUDA: keep adapters' host copies pageable (default: page-locked, lora_page_lock)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per CPU-assisted prefill chunk (0: whole prompts)")
    p.add_argument("--processes", type=int, default=None, help="CPU LoRA helpers (default: one per helper core)")
    p.add_argument("--threads", type=int, default=None, help="engine torch threads (default: the engine's cores)")
    p.add_argument("--modes", help="comma-separated subset of " + ",".join(MODES) + " (default: all, less the "
                   "Cached arm that would repeat cached's kernel)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: a quarter of hidden/64)")
    p.add_argument("--dtype", default="float32", help="the generated model's dtype (bfloat16 for a GPU run)")
    p.add_argument("--budget", type=int, default=2048, help="step token budget (also the helpers' shared rows)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _targets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TARGETS and t not in TARGETS.values()]
    if bad or not names:
        raise SystemExit(f"--targets: unknown {bad or text!r}; choose from {','.join(TARGETS)}")
    return [t.removesuffix("_proj") for t in names]


def make_assets(root: Path, ranks: list[int], targets: list[str], layers: int, hidden: int, seed: int, *,
                kv_heads: int | None = None, dtype: str = "float32") -> tuple[Path, dict[int, Path]]:
    """The model and one adapter directory per rank (each round registers fresh names over them)."""
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    heads = max(1, hidden // 64)
    model = make_model(root / "model", arch="llama", layers=layers, hidden=hidden, heads=heads,
                       kv_heads=kv_heads or max(1, heads // 4), intermediate=int(hidden * 2.6875) // 8 * 8, vocab=2048,
                       seed=seed, dtype=dtype)
    return model, {r: make_lora(root / f"lora-r{r}", model, rank=r, targets=targets, seed=seed + r)
                   for r in sorted(set(ranks))}


def _calibrate(me: ModeEngine, adapter: Path, prompt_len: int, repeats: int = 7) -> float:
    """Fastest prefill (+ first token) of a typical prompt with a resident adapter of the largest rank."""
    from services.gpu_worker.engine.sampling_params import SamplingParams

    eng = me.engine
    eng.add_lora("calibrate", adapter)
    eng.runner.lora.ensure_resident(["calibrate"])
    prompt = [1 + (7 * i) % 1000 for i in range(prompt_len)]
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0), adapters=["calibrate"])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    eng.remove_lora("calibrate")
    return min(times)


def _modes(text: str, ratios: str) -> list[str]:
    """--modes with each CPU arm once per --cpu-ratio (`cpu_assist@R`; 'native': unpaced, no suffix)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or "cached" not in names:
        raise SystemExit(f"--modes: {bad or 'cached is missing'}; choose from {', '.join(MODES)} (cached is the baseline)")
    suffixes = []
    for r in (x.strip() for x in ratios.split(",") if x.strip()):
        if r == "native":
            suffixes.append("")
            continue
        try:
            if float(r) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--cpu-ratio: {r!r} is not a number > 0 nor 'native'") from None
        suffixes.append(f"@{r}")
    if not suffixes:
        raise SystemExit("--cpu-ratio: give at least one ratio (or 'native')")
    return [m + sfx for m in names for sfx in (suffixes if m in ASSISTED else [""])]


def run(args: argparse.Namespace) -> int:
    import torch

    workload = WORKLOADS[args.workload]
    modes = _modes(args.modes or ",".join(m for m in MODES if m == "cached" or m not in CACHED
                                          or kernel_of(m, args.kernel) != args.kernel), args.cpu_ratio)
    missing = [m for m in modes if m not in CACHED and baseline_of(m, modes, args.kernel) is None]
    if missing:
        raise SystemExit(f"--modes: {missing} need a Cached arm on their kernel "
                         f"({', '.join(sorted({kernel_of(m, args.kernel) for m in missing}))}): add cached_bgmv / "
                         f"cached_mbgmv")
    if args.rounds < 1 or args.requests < 1:
        raise SystemExit(f"--rounds and --requests must be >= 1, got {args.rounds}, {args.requests}")
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(workload.ranks)
    cold = 1.0 if args.cold_fraction is None else args.cold_fraction
    if not 0.0 < cold <= 1.0:
        raise SystemExit(f"--cold-fraction must be in (0, 1], got {cold}")
    if args.cold_fraction is not None and workload.adapters:
        raise SystemExit("--cold-fraction is for the synthetic workloads (MAF-like: popularity decides)")
    targets = _targets(args.targets)
    cuda = args.device.startswith("cuda")
    split = split_cores(usable_cores(), args.processes)
    processes = args.processes or max(1, len(split.helpers))
    pin_engine(split)  # undone at the end (a caller in this process keeps its cores)
    threads = args.threads or max(1, len(split.engine))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, workload, modes, ranks, cold, targets, cuda, split, processes, threads, out)
    finally:
        torch.set_num_threads(before)
        pin_engine(CoreSplit(split.machine, split.machine, split.machine))


def _run(args, workload, modes, ranks, cold, targets, cuda, split, processes, threads, out) -> int:  # type: ignore[no-untyped-def]
    import torch

    from services.gpu_worker.engine.cpu_lora_wire import GROUP_OF
    from shared.config_units import Bandwidth

    model, files = make_assets(out / "assets", ranks, targets, args.layers, args.hidden, args.seed,
                               kv_heads=args.kv_heads, dtype=args.dtype)
    ckpt = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    pool = 2 * ckpt + (1 << 30)
    max_len = args.prompt_len[1] + args.output_len + 16
    common = dict(device=args.device, kernel=args.kernel, processes=processes, cores=split.helpers, chunk=args.chunk,
                  page_lock=not args.pageable,
                  max_model_len=max(256, max_len), budget=args.budget, max_seqs=64)
    engines: dict[str, ModeEngine] = {}
    try:
        engines["cached"] = ModeEngine("cached", make_engine("cached", model, bandwidth=None, pool_bytes=pool, **common))
        rank = 64 if 64 in files else max(ranks)
        typical = round(sum(args.prompt_len) / 2)
        prefill_s = _calibrate(engines["cached"], files[max(ranks)], typical)
        eng = engines["cached"].engine
        eng.add_lora("size", files[64] if 64 in files else files[max(ranks)])
        eng.runner.lora.ensure_resident(["size"])
        big = eng.runner.lora.resident["size"][0].nbytes * (64 / (64 if 64 in files else max(ranks)))
        eng.remove_lora("size")
        if args.load_bandwidth:
            bandwidth: float | None = float(Bandwidth.parse(args.load_bandwidth))
        else:
            bandwidth = None if cuda else paced_bandwidth(int(big), prefill_s)
        rate = args.rate or scaled_rate(workload.paper_rps, prefill_s)
        calls = args.layers * len({GROUP_OF[t + "_proj"] for t in targets})  # helper calls per CPU-assisted step
        paces = {m: cpu_pace(float(m.partition("@")[2]), prefill_s, typical, rank, calls, processes)
                 for m in modes if "@" in m}
        # each kernel's arms at the paper's rate and load share scaled by the prefill of its own Cached
        prefill_of = {args.kernel: prefill_s}
        for c in CACHED:
            if c in modes and c != "cached":
                engines[c] = ModeEngine(c, make_engine(c, model, bandwidth=None, pool_bytes=pool, **common))
                prefill_of[kernel_of(c, args.kernel)] = _calibrate(engines[c], files[max(ranks)], typical)
        for mode in modes:
            if mode not in engines:
                stretch = prefill_of[kernel_of(mode, args.kernel)] / prefill_s
                engines[mode] = ModeEngine(mode, make_engine(
                    mode, model, bandwidth=None if bandwidth is None or args.load_bandwidth else bandwidth / stretch,
                    pool_bytes=pool, cpu_pace=paces.get(mode, 0.0), **common))
        for mode in modes:
            if base_mode(mode) in ASSISTED:
                engines[mode].engine.cold.start_helpers(wait=True)
        reuse = 0.0 if workload.adapters else 1.0 - cold
        trace = make_trace(args.requests, rate, tuple(args.prompt_len), 2048, reuse, args.seed,
                           ranks=tuple(ranks), adapters=workload.adapters, cv=workload.cv)
        traces = {k: [dataclasses.replace(r, at_s=r.at_s * p / prefill_s) for r in trace] for k, p in prefill_of.items()}
        baselines = {m: baseline_of(m, modes, args.kernel) for m in modes if m not in CACHED}
        n_cold = sum(r.cold for r in trace)
        print(f"lora bench: workload {workload.name} ({workload.about}); {args.requests} requests x {args.rounds} "
              f"rounds at {rate:.2f} RPS ({'paper ' + format(workload.paper_rps, 'g') + ' RPS scaled by the prefill here' if not args.rate else '--rate'}"
              f", arrival CV {workload.cv:g}), {n_cold} cold / {args.requests - n_cold} warm, ranks "
              f"{'/'.join(map(str, sorted(set(ranks))))} on {','.join(targets)}, output {args.output_len} tokens; "
              f"device {args.device}, {args.layers} layers, hidden {args.hidden}, {args.dtype}")
        print(f"{split.describe()}; engine torch threads {threads}, CPU LoRA helpers {processes}")
        print("kernels: " + "; ".join(f"{k} ({'BGMV' if k == 'padded' else 'MBGMV'}): "
                                      f"{','.join(m for m in modes if kernel_of(m, args.kernel) == k)}, typical prefill "
                                      f"{p * 1000:.1f} ms, rate {rate * prefill_s / p:.2f} RPS" + (
                                          "" if bandwidth is None else f", loads {bandwidth * prefill_s / p / 1e6:.1f} MB/s")
                                      for k, p in prefill_of.items()) + "; each mode against the Cached on its kernel")
        if paces:
            print("CPU LoRA pacing: " + "; ".join(
                f"{m.partition('@')[0]} at {m.partition('@')[2]} x the prefill: {p * 1e9:.1f} ns per row x rank per call "
                f"({calls} calls a step, {processes} helper(s))" for m, p in paces.items() if m.startswith("cpu_assist"))
                  + f" (paper server, lora_stats.py: {CPU_RATIOS[0]} bf16 / {CPU_RATIOS[1]} fp32 on 8 cores)")
        if cuda:
            how = (f"real host-to-device copies from {'pageable' if args.pageable else 'page-locked'} host copies, "
                   f"unpaced" if bandwidth is None
                   else f"paced to {bandwidth / 1e9:.2f} GB/s (--load-bandwidth)")
            print(f"loads: {how}; rank-64 adapter {big / 1e6:.1f} MB; typical ({typical}-token) prefill "
                  f"{prefill_s * 1000:.1f} ms")
        else:
            print(f"load pacing: prefill of a {typical}-token prompt here {prefill_s * 1000:.1f} ms (fastest of 7, adapter "
                  f"resident); paper: rank-64 load {PAPER_RANK64_LOAD_S * 1000:.1f} ms / prefill "
                  f"{PAPER_TYPICAL_PREFILL_S * 1000:.0f} ms = {PAPER_LOAD_OVER_PREFILL:.2f} -> a rank-64 adapter "
                  f"({big / 1e6:.2f} MB) loads in {big / bandwidth * 1000:.1f} ms: {bandwidth / 1e6:.1f} MB/s"
                  + (" (--load-bandwidth)" if args.load_bandwidth else " (derived)"), flush=True)
        sync = torch.cuda.synchronize if cuda else None
        warm = [type(trace[0])(0.0, trace[0].prompt[:32], j, True, max(ranks)) for j in range(WARMUPS)]
        for mode in modes:
            me = engines[mode]
            register_round(me, [(f"{mode}-warm-{j}", files[max(ranks)]) for j in range(WARMUPS)])
            drive(me.engine, warm, me.names, 2, sync=sync)
        rounds, steps = [], {m: {"prefill": [], "decode": []} for m in modes}
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
            rec = {}
            for mode in order:
                me = engines[mode]
                names = [f"{mode}-{rnd}-{r.slot}" for r in trace]
                register_round(me, sorted({(n, files[r.rank]) for n, r in zip(names, trace)}))
                res = drive(me.engine, traces[kernel_of(mode, args.kernel)], names, args.output_len, sync=sync)
                rec[mode] = res.requests
                steps[mode]["prefill"] += res.prefill_steps_s
                steps[mode]["decode"] += res.decode_steps_s
            rounds.append(rec)
            print(f"  round {rnd + 1}/{args.rounds} ({' '.join(order)}): mean TTFT "
                  + "  ".join(f"{m} {statistics.fmean(r['ttft_s'] for r in rec[m]) * 1000:.0f} ms" for m in modes),
                  flush=True)
        cold_stats = {m: {k: getattr(engines[m].engine.cold, k) for k in
                          ("cpu_chunks", "device_takeovers", "mid_step_takeovers", "uncut", "fallbacks",
                           "inline_loads", "inline_wait_s")}
                      for m in modes}
        views = {m: rule_view(engines[m].engine, typical, rank, int(big)) for m in modes if base_mode(m) in ASSISTED}
    finally:
        for me in engines.values():
            me.engine.cold.close()
    which = "all" if workload.adapters else "cold"
    over = print_report(rounds, modes, steps, baselines)
    for m, ca in cold_stats.items():
        if base_mode(m) in ASSISTED:
            print(f"{m}: {ca['cpu_chunks']} prefill chunks on the helpers, {ca['device_takeovers']} prefills taken "
                  f"over by the device mid-prompt ({ca['mid_step_takeovers']} inside a step; {ca['uncut']} chunks left "
                  f"whole), {ca['fallbacks']} fallbacks, {ca['inline_loads']} inline loads")
    print("CPU arms (measured by each engine over the run):")
    print_choices(views, typical, rank, prefill_s)
    assist = next((m for m in modes if base_mode(m) == "cpu_assist"), None)
    inline = next((cold_stats[m] for m in ("ondemand", "slora") if m in cold_stats and cold_stats[m]["inline_loads"]),
                  None)
    if assist and inline and steps[assist]["prefill"] and steps["cached"]["prefill"]:
        load_ms = inline["inline_wait_s"] / inline["inline_loads"] * 1000
        cached_ms, assist_ms = (statistics.fmean(steps[m]["prefill"]) * 1000 for m in ("cached", assist))
        print(f"what decides it: a load takes {load_ms:.1f} ms inside OnDemand's iteration (the batch waits); a "
              f"prefill iteration takes {cached_ms:.1f} ms cached, {assist_ms:.1f} ms with CPU-assisted chunks of "
              f"{args.chunk} tokens (the helpers' x·A·B and a round trip per layer, "
              f"{len(split.helpers) or 'no'} core(s) of their own)")
    (out / "results.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "func"}, "workload": workload.name, "rate": rate,
        "prefill_s": prefill_s, "rank64_bytes": big, "kernels": {m: kernel_of(m, args.kernel) for m in modes},
        "cpu_paces": paces, "decision_rule": views, "bandwidth": bandwidth, "cores": {
            "machine": list(split.machine), "engine": list(split.engine), "helpers": list(split.helpers)},
        "processes": processes, "threads": threads, "engine_counters": cold_stats, "steps": steps,
        "baselines": baselines, "prefill_s_by_kernel": prefill_of, "overheads": over,
        "overheads_of_medians": round_overheads(rounds, modes, "median", baselines), "rounds": rounds}, indent=1))
    print(f"(files in {out}; paper, Llama2-7B on an A10, rank 64, 9 RPS, every request cold: TTFT +22% CaraServe, "
          f"+412% OnDemand, +451% S-LoRA)")
    first = next((m for m in modes if base_mode(m) in ASSISTED), "")
    ratio = "@" + first.partition("@")[2] if "@" in first else ""
    auto = views.get("auto" + ratio)
    print(summary_line(over, which, auto["choices"] if auto else None, ratio))
    return 0


if __name__ == "__main__":  # `python -m tidal.bench.lora ...`: this bench alone (the GPU machine)
    import sys

    sys.exit(run_alone(register, "lora", sys.argv[1:]))
