"""tidal bench lora-invoke: a cold adapter's prefill step with CPU LoRA helpers, invoked
sync-free vs the native way (CaraServe §4.2, Fig. 8 and Fig. 16).

One engine on `--device`, a generated model and adapter; the adapter's load is held back so
every timed step is a prefill chunk whose LoRA deltas come from the helper processes. The
two invocations alternate request by request in the same engine: sync-free (the rows go to
the helpers by an async device-to-host copy with the signal queued behind it) and native (a
blocking copy, then the signal). Meaningful on CUDA; on a CPU engine both are the same
memory copy (printed as such). Paper: up to 16% lower prefill latency (Llama2-7B, A10).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from tidal.bench.output import add_out_argument, out_dir, run_alone


def _engine(model: Path, adapter: Path, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(str(model), device=args.device, pool_bytes=args.pool_mib << 20,
                                 max_prefill_chunk=args.tokens, max_num_batched_tokens=args.tokens, max_num_seqs=4,
                                 cpu_lora_assist=True, cpu_lora_processes=args.processes, lora_load_bandwidth=1e9))
    eng.add_lora("cold", adapter)
    eng.cold.start_helpers()
    eng.runner.cpu_lora.wait_ready()
    return eng


def _prefill_step(eng, rid: str, prompt: list[int]) -> float:  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.sampling_params import SamplingParams

    eng.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0), adapter="cold")
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize(eng.runner.device)
    t0 = time.perf_counter()
    eng.step()  # the whole prompt is one chunk on the helpers (the load is held back)
    took = time.perf_counter() - t0
    eng.abort(rid)
    eng.step()
    return took


def run_bench(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    started = time.time()
    times: dict[str, list[float]] = {"sync_free": [], "native": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "m", arch="llama", layers=args.layers, hidden=args.hidden, heads=args.heads,
                           kv_heads=args.heads, vocab=512, seed=2)
        adapter = make_lora(Path(tmp) / "a", model, rank=args.rank, targets=args.targets.split(","), seed=1)
        eng = _engine(model, adapter, args)
        hold = threading.Event()
        eng.cold.loads._sleep = lambda _s: hold.wait(3600)  # noqa: SLF001 - the load never lands while timed
        try:
            prompt = torch.randint(1, 500, (args.tokens,), generator=torch.Generator().manual_seed(3)).tolist()
            helpers = eng.runner.cpu_lora
            for i in range(args.warmup + args.repeats):
                for mode in (("sync_free", "native") if i % 2 == 0 else ("native", "sync_free")):
                    helpers.sync_free = mode == "sync_free"
                    took = _prefill_step(eng, f"{mode}-{i}", prompt)
                    if i >= args.warmup:
                        times[mode].append(took)
            assert eng.cold.cpu_chunks > 0 and eng.cold.fallbacks == 0, "the timed steps did not run on the helpers"
        finally:
            hold.set()
            eng.cold.close()
    free, native = statistics.median(times["sync_free"]), statistics.median(times["native"])
    gain = (native - free) / native * 100
    print(f"# lora-invoke: {args.layers} layers, hidden {args.hidden}, rank {args.rank} on {args.targets}, one prefill chunk of "
          f"{args.tokens} tokens on {args.processes} CPU LoRA helpers, device {args.device}, {args.repeats} repeats")
    print(f"{'invocation':>10} | {'p50 ms':>8} | {'min ms':>8}")
    for mode in ("native", "sync_free"):
        print(f"{mode:>10} | {statistics.median(times[mode]) * 1e3:>8.2f} | {min(times[mode]) * 1e3:>8.2f}")
    if not args.device.startswith("cuda"):
        print("# on a CPU engine both invocations are the same memory copy: no gain is expected")
    out = out_dir(args, started)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps({"times_s": times, "args": vars(args) | {"func": None}}, indent=1,
                                               default=str))
    print(f"# steps: {out / 'steps.json'}")
    print(f"bench lora-invoke: prefill_ms_sync_free={free * 1e3:.2f} prefill_ms_native={native * 1e3:.2f} "
          f"prefill_gain={gain:.0f}%")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("lora-invoke", help="CPU LoRA prefill step: sync-free invocation vs native (CUDA)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down", help="projections the adapter adapts")
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens (one prefill chunk)")
    parser.add_argument("--processes", type=int, default=4, help="CPU LoRA helper processes")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pool-mib", type=int, default=2048)
    add_out_argument(parser, "bench-lora-invoke")
    parser.set_defaults(func=run_bench)



if __name__ == "__main__":  # `python -m tidal.bench.lora_invoke ...`: this bench alone (the GPU machine)
    import sys

    sys.exit(run_alone(register, "lora-invoke", sys.argv[1:]))
