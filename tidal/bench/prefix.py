"""`tidal bench prefix`: prefix caching and prefix-aware routing, live on the default cluster, three arms in
one run — caching off; caching on (routing by load); caching on + prefix-aware routing.

The workload is two seeded prefix-sharing traces merged on one timeline (loadgen/traces/prefix.py, the
shapes `tidal trace prefix-chat` and `tidal trace prefix-system` write):

* multi-turn chat: conversations start at `--chat-rate`/s (0.1), 3-6 turns, each turn's prompt the conversation
  so far (own 64-token system prompt, 48-128-token user messages, 32-token reply stand-ins) + a new user
  message, ~4 s apart;
* shared system prompts: `--system-rate` requests/s (0.3), each one of `--prompts` (2) system prompts of
  `--system-tokens` (384) tokens + its own 32-96-token question, 16 tokens out.

`--duration` (40 s) of arrivals per arm: 20 requests (seed 0), sized so an arm ends in a few minutes on a busy
2-core box (each worker has one torch thread).

Each arm starts the default cluster afresh (`shared/default_cluster.toml`: two CPU workers, SmolLM2-135M
and the demo models, the planner; prefix_drive.py) — with the planner's request migrations off unless
`--planner-migration` (MELL's consolidation moves running requests onto one worker, each move a re-prefill:
measured, it piled 25 of 29 requests onto one worker), warms it, sends the same requests at the same times
through the official `openai` client (greedy, `ignore_eos`) and stops it. Per arm: TTFT P50/P99 (and per
shape), completion tokens/s and requests/s, and per worker the requests it served and its block hit rate
(hit / looked-up full prompt blocks, from its `PrefixSummary` counters). Last line: the TTFT cuts of
caching off against caching on + routing, both arms' hit rates, and whether every request's greedy output
was the same in all three arms:
`bench prefix: ttft_p50_cut=N.Nx ttft_p99_cut=N.Nx hit_rate=NN% routed_hit_rate=NN% tokens_equal=yes`
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

from tidal.bench.output import add_out_argument, out_dir

WARMUPS = 4  # concurrent short requests after start (both workers' first steps), before the trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefix", help="prefix caching off / on / on + prefix-aware routing, live (default cluster)")
    add_out_argument(p, "prefix")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per arm (default 40)")
    p.add_argument("--chat-rate", type=float, default=0.1, help="new conversations per second (default 0.1)")
    p.add_argument("--system-rate", type=float, default=0.3, help="shared-system-prompt requests/s (default 0.3)")
    p.add_argument("--prompts", type=int, default=2, help="distinct system prompts (default 2)")
    p.add_argument("--system-tokens", type=int, default=384, help="tokens per system prompt (default 384)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default="off,on,routed", help="a subset of off,on,routed (the line needs all three)")
    p.add_argument("--data-dir", default=".tidal", help="where models are built and cached (default .tidal)")
    p.add_argument("--planner-migration", action="store_true",
                   help="keep the default config's request migrations (MELL consolidation); default: off in every arm")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.set_defaults(func=run)


def workload(args: argparse.Namespace, model: str) -> list[tuple[str, object]]:
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PrefixChatParams, PrefixSystemParams

    chat = generate(PrefixChatParams(seed=args.seed, duration_s=args.duration, rate=args.chat_rate, model=model))
    system = generate(PrefixSystemParams(seed=args.seed, duration_s=args.duration, rate=args.system_rate, model=model,
                                         prompts=args.prompts, system_tokens=args.system_tokens))
    merged = [("chat", r) for r in chat.records] + [("system", r) for r in system.records]
    merged.sort(key=lambda item: item[1].arrival_s)
    return merged


async def _warm(url: str, model: str) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=120.0, max_retries=0)
    try:
        await asyncio.gather(*(client.completions.create(
            model=model, prompt=[17 + i] * 48, max_tokens=4, temperature=0.0) for i in range(WARMUPS)))
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    from tidal.bench.prefix_drive import DEFAULT_CONFIG, run_arm, start_cluster
    from tidal.bench.prefix_stats import ARMS, ArmResult, arm_lines, summary_line
    from shared.logging import configure_logging
    from tidal.commands.trace import config_models

    configure_logging("bench-prefix", level="warning")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        print(f"error: --arms takes a subset of {','.join(ARMS)}")
        return 2
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    base = DEFAULT_CONFIG.read_text()
    model = config_models(str(DEFAULT_CONFIG))[0]
    records = workload(args, model)
    data_dir = Path(args.data_dir).absolute()
    shapes = {s: sum(1 for k, _ in records if k == s) for s in ("chat", "system")}
    print(f"bench prefix: {len(records)} requests per arm ({shapes['chat']} chat turns, {shapes['system']} "
          f"shared-system-prompt), {args.duration:.0f} s of arrivals, model {model}, arms {','.join(arms)}; "
          f"files in {out}")
    results: dict[str, ArmResult] = {}
    for arm in arms:
        started = time.monotonic()
        services, url = start_cluster(arm, out / arm, data_dir, base, model, migration=args.planner_migration)
        try:
            asyncio.run(_warm(url, model))
            ready = time.monotonic() - started
            results[arm] = asyncio.run(run_arm(arm, services, url, records, seed=args.seed, model=model,  # type: ignore[arg-type]
                                               timeout_s=args.request_timeout))
        finally:
            services.stop()
        print(f"[{arm}] cluster ready in {ready:.0f} s, arm done in {time.monotonic() - started:.0f} s", flush=True)
        for line in arm_lines(results[arm]):
            print(line, flush=True)
    (out / "results.json").write_text(json.dumps({a: asdict(r) for a, r in results.items()}, indent=1))
    if all(a in results for a in ARMS):
        line = summary_line(results)
        (out / "summary.txt").write_text(line + "\n")
        print(line)
    return 0
