"""tidal bench kunserve-exchange: decode steps while a buddy group exchanges KV (KunServe §4.2).

Two members of a group in one process (services/gpu_worker/group/loopback.py: the real
stage protocol and wire format, KV frames overtaken by activations), each with running
requests when the group forms. Those victims keep decoding on remote attention while
their KV of the dropped layers moves over, one layer's KV per round ("a chunk"). The
same requests are then run with no exchange (admitted to the group, so their KV is
already where the layers are) and the decode rounds at the same positions are timed. A step is one member's: deliver its frames (at most one KV
chunk), launch a micro-batch, queue its next chunk (each member is its own machine).
Goal: no step during the exchange over 2x a normal step plus one chunk time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tidal.bench.output import add_out_argument, out_dir, run_alone

BINS = (1.25, 1.5, 2.0, 3.0)  # step / baseline median


def _members(model: Path, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.group.loopback import Loopback
    from services.gpu_worker.group.member import GroupMember

    loop = Loopback()

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(str(model), device=args.device, pool_bytes=args.pool_mib << 20, block_size=16,
                                      max_num_seqs=64, max_num_batched_tokens=4096))

    return loop, loop.add(GroupMember(engine(), "a", loop.port("a"))), loop.add(GroupMember(engine(), "b", loop.port("b")))


def _requests(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [(f"r{i}", torch.randint(0, 500, (args.prompt,), generator=g).tolist()) for i in range(2 * args.requests)]


def _sync(members) -> None:  # type: ignore[no-untyped-def]
    """On CUDA, wait for the queued kernels, so a step's time includes its device work."""
    for m in members:
        if m.engine.runner.device.type == "cuda":
            torch.cuda.synchronize(m.engine.runner.device)


def _round(loop, members) -> list[float]:  # type: ignore[no-untyped-def]
    """One step of each member (its own machine in a real group): deliver, launch, exchange."""
    took = []
    for m in members:
        _sync([m])
        t0 = time.perf_counter()
        loop.deliver(m.member_id, kv_per_round=1)
        m.step()
        m.pump_exchange(1)
        _sync([m])
        took.append(time.perf_counter() - t0)
    return took


def _run(model: Path, args: argparse.Namespace, *, exchange: bool) -> tuple[list[float], dict[str, float]]:
    from services.gpu_worker.engine.sampling_params import SamplingParams
    from services.gpu_worker.group.member import Stage

    loop, a, b = _members(model, args)
    half = args.layers // 2
    stages = [Stage("a", range(0, half)), Stage("b", range(half, args.layers))]
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 8, ignore_eos=True)
    if not exchange:
        a.join("g", stages), b.join("g", stages)
    for i, (rid, prompt) in enumerate(_requests(args)):
        (a if i % 2 == 0 else b).engine.add_request(rid, prompt, params)
    if exchange:  # alone until the burst: prefill and a few tokens, then the group forms
        for _ in range(args.warmup):
            a.engine.step(), b.engine.step()
        a.join("g", stages), b.join("g", stages)
    else:
        for _ in range(args.warmup + 2):  # the same positions: prefill rounds and warm-up tokens
            _round(loop, [a, b])
    steps = [t for _ in range(args.steps) for t in _round(loop, [a, b])]
    info = {"kv_bytes": float(loop.kv_bytes), "remote_attention": float(a.holder.served + b.holder.served),
            "exchanging_at_end": float(a.exchanging or b.exchanging)}
    return steps, info


def _chunk_time(model: Path, args: argparse.Namespace) -> float:
    """Seconds to move one layer's KV of one member's victims (export, wire, import) on its own."""
    from services.gpu_worker.group.member import Stage
    from services.gpu_worker.engine.sampling_params import SamplingParams

    loop, a, b = _members(model, args)
    for rid, prompt in _requests(args)[::2]:
        a.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(args.warmup):
        a.engine.step()
    half = args.layers // 2
    stages = [Stage("a", range(0, half)), Stage("b", range(half, args.layers))]
    a.join("g", stages), b.join("g", stages)
    _sync([a, b])
    t0 = time.perf_counter()
    a.pump_exchange(1)
    loop.deliver("b", kv_per_round=1)
    _sync([a, b])
    return time.perf_counter() - t0


def _histogram(steps: list[float], unit: float) -> list[int]:
    counts = [0] * (len(BINS) + 1)
    for s in steps:
        counts[next((i for i, b in enumerate(BINS) if s <= b * unit), len(BINS))] += 1
    return counts


def run_bench(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine.checkpoint_gen import make_model

    torch.set_num_threads(args.threads)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "m", arch="llama", layers=args.layers, hidden=args.hidden, heads=args.heads,
                           kv_heads=args.heads, vocab=512, seed=2)
        baseline, _ = _run(model, args, exchange=False)
        during, info = _run(model, args, exchange=True)
        chunk = _chunk_time(model, args)
    normal = statistics.median(baseline)
    print(f"# kunserve-exchange on {args.device}: {args.layers} layers, hidden {args.hidden}, {2 * args.requests} victims of "
          f"{args.prompt} tokens, {args.steps} decode rounds; KV moved {info['kv_bytes'] / 2**20:.1f} MiB in "
          f"{args.layers} layer chunks, {int(info['remote_attention'])} remote attention calls")
    print(f"# normal step (no exchange, p50) {normal * 1e3:.2f} ms; one chunk alone {chunk * 1e3:.2f} ms")
    print(f"{'step / normal':>14} | {'no exchange':>11} | {'exchange':>8}")
    labels = [f"<= {b:.2f}x" for b in BINS] + [f"> {BINS[-1]:.2f}x"]
    for label, base, exch in zip(labels, _histogram(baseline, normal), _histogram(during, normal)):
        print(f"{label:>14} | {base:>11} | {exch:>8}")
    p99 = sorted(during)[max(0, int(0.99 * len(during)) - 1)]
    base_p99 = sorted(baseline)[max(0, int(0.99 * len(baseline)) - 1)]
    ratio = max(during) / normal
    goal = (2 * normal + chunk) / normal
    print(f"# max step {max(during) * 1e3:.2f} ms; goal: under 2x normal + one chunk = {goal:.2f}x normal "
          f"({'met' if ratio <= goal else 'missed'})")
    out = out_dir(args, started)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps({"baseline_s": baseline, "exchange_s": during, "chunk_s": chunk,
                                                **info, "args": vars(args) | {"func": None}}, indent=1, default=str))
    print(f"# steps: {out / 'steps.json'}")
    print(f"bench kunserve-exchange: max_step_ratio={ratio:.2f} p99_step_ms={p99 * 1e3:.1f} "
          f"baseline_p99_step_ms={base_p99 * 1e3:.1f}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("kunserve-exchange", help="decode steps during a buddy group's live KV exchange vs none")
    parser.add_argument("--device", default="cpu", help="the members' device (cpu or cuda:N)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="victims per member")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of each request")
    parser.add_argument("--warmup", type=int, default=4, help="steps each member runs alone before the group forms")
    parser.add_argument("--steps", type=int, default=24, help="decode rounds timed")
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    add_out_argument(parser, "bench-kunserve-exchange")
    parser.set_defaults(func=run_bench)



if __name__ == "__main__":  # `python -m tidal.bench.kunserve_exchange ...`: this bench alone (the GPU machine)
    import sys

    sys.exit(run_alone(register, "kunserve-exchange", sys.argv[1:]))
