"""`tidal profile lora`: time the engine's multi-LoRA steps and fit CaraServe's §5 models.

For each kernel (`padded`, `segmented`) an `LLMEngine` runs with that `lora_mode` and one
adapter per rank (all made resident before timing, so no load is timed). Two families:

- decode: a batch of B sequences whose adapters have the given ranks (homogeneous batches of
  each rank, and mixed ones: one high-rank request among low ones, where padding costs most),
  every one decoding; the median of `steps` timed steps;
- prefill: k fresh prompts of L tokens with given ranks prefilled in one step; the median of
  `repeats`.

The samples go to `shared.policy.lora_perf_model.fit_model` (least squares, R^2). The
model and adapters are generated (`make_model`, `make_lora`) unless a checkpoint is given.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.policy.lora_perf_model import (
    KERNELS, DecodeSample, Kernel, LoraPerfModel, LoraPerfProfile, PrefillSample, fit_model,
)


@dataclass(frozen=True)
class LoraSweep:
    kernels: tuple[Kernel, ...] = KERNELS
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    batches: tuple[int, ...] = (1, 4, 8, 16)
    context: int = 32  # prompt tokens of each decoding sequence
    steps: int = 5  # decode steps timed per point (median kept)
    prompts: tuple[int, ...] = (32, 128)  # prefill lengths
    prefill_counts: tuple[int, ...] = (1, 2)  # prompts prefilled together
    repeats: int = 3
    threads: int = 1
    hidden: int = 512  # the generated model's width (large enough that LoRA is visible on a CPU)
    layers: int = 2
    seed: int = 0
    model_dir: str | None = None  # an existing checkpoint instead of a generated one
    fastest: bool = False  # keep each point's fastest time, not its median: on a host shared with other
    # work the fastest is the closest to the uncontended step (`repro caraserve --live` profiles so)
    extra: dict[str, str] = field(default_factory=dict)


def decode_batches(sweep: LoraSweep) -> list[tuple[int, ...]]:
    """Homogeneous batches per (B, rank) and, for B > 1, one max-rank request among min-rank ones."""
    lo, hi = min(sweep.ranks), max(sweep.ranks)
    out = [(r,) * b for b in sweep.batches for r in sweep.ranks]
    out += [(lo,) * (b - 1) + (hi,) for b in sweep.batches if b > 1 and lo != hi]
    return out


def prefill_sets(sweep: LoraSweep) -> list[tuple[tuple[int, int], ...]]:
    lo, hi = min(sweep.ranks), max(sweep.ranks)
    out = [((p, r),) * k for p in sweep.prompts for k in sweep.prefill_counts for r in (lo, hi)]
    out += [((p, lo), (p, hi)) for p in sweep.prompts if lo != hi]
    return out


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(min(16, vocab - 1), vocab) for _ in range(n)]


def _engine(model_dir: Path, adapters: dict[int, Path], kernel: Kernel, sweep: LoraSweep, budget: int):  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), pool_bytes=1 << 30, max_num_seqs=max(sweep.batches),
                                    max_num_batched_tokens=budget, lora_mode=kernel, num_threads=sweep.threads))
    for rank, path in adapters.items():
        engine.add_lora(f"r{rank}", path)
    engine.runner.lora.ensure_resident([f"r{r}" for r in adapters])  # loads are not what is timed
    return engine


def _keep(sweep: LoraSweep, times: list[float]) -> float:
    return min(times) if sweep.fastest else statistics.median(times)


def _drain(engine, ids: list[str]) -> None:  # type: ignore[no-untyped-def]
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()


def measure_decode(engine, batches: list[tuple[int, ...]], sweep: LoraSweep, vocab: int) -> list[DecodeSample]:  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.sampling_params import SamplingParams

    rng = random.Random(sweep.seed)
    params = SamplingParams(temperature=0, max_tokens=sweep.steps + 8, ignore_eos=True)
    samples = []
    for n, ranks in enumerate(batches):
        ids = [f"dec-{n}-{i}" for i in range(len(ranks))]
        for rid, rank in zip(ids, ranks):
            engine.add_request(rid, _ids(rng, sweep.context, vocab), params, adapter=f"r{rank}" if rank else None)
        while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()  # prefill until every sequence decodes
        times = []
        for _ in range(sweep.steps):
            if len(engine.scheduler.running) != len(ranks):
                break
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        _drain(engine, ids)
        if times:
            samples.append(DecodeSample(ranks=ranks, seconds=_keep(sweep, times)))
    return samples


def measure_prefill(engine, sets: list[tuple[tuple[int, int], ...]], sweep: LoraSweep,  # type: ignore[no-untyped-def]
                    vocab: int) -> list[PrefillSample]:
    from services.gpu_worker.engine.sampling_params import SamplingParams

    rng = random.Random(sweep.seed + 1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    samples = []
    for n, prompts in enumerate(sets):
        times = []
        for rep in range(sweep.repeats):
            ids = [f"pre-{n}-{rep}-{i}" for i in range(len(prompts))]
            for rid, (tokens, rank) in zip(ids, prompts):
                engine.add_request(rid, _ids(rng, tokens, vocab), params, adapter=f"r{rank}" if rank else None)
            start = time.perf_counter()
            engine.step()  # every prompt whole in one step (within the step budget)
            times.append(time.perf_counter() - start)
            _drain(engine, ids)
        samples.append(PrefillSample(prompts=prompts, seconds=_keep(sweep, times)))
    return samples


def profile_lora(sweep: LoraSweep, name: str = "lora") -> tuple[LoraPerfProfile, list[str]]:
    """Measure both kernels on the real engine; the fitted profile and lines describing it."""
    import torch

    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    torch.set_num_threads(sweep.threads)
    models: dict[str, LoraPerfModel] = {}
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tidal-profile-lora-") as tmp:
        root = Path(tmp)
        if sweep.model_dir is None:
            model_dir = make_model(root / "model", layers=sweep.layers, hidden=sweep.hidden, heads=8, kv_heads=4,
                                   seed=sweep.seed)
        else:
            model_dir = Path(sweep.model_dir)
        adapters = {r: make_lora(root / f"lora-r{r}", model_dir, rank=r, seed=sweep.seed + r) for r in sweep.ranks}
        batches, sets = decode_batches(sweep), prefill_sets(sweep)
        budget = max(max(sweep.batches), max(sum(t for t, _ in s) for s in sets))
        for kernel in sweep.kernels:
            engine = _engine(model_dir, adapters, kernel, sweep, budget)
            vocab = engine.runner.cfg.vocab_size
            engine.step()  # nothing to do: a first call pays any lazy setup
            measure_decode(engine, batches[:1], sweep, vocab)  # warm-up
            decode = measure_decode(engine, batches, sweep, vocab)
            prefill = measure_prefill(engine, sets, sweep, vocab)
            model = models[kernel] = fit_model(kernel, decode, prefill)
            feature = "B x max rank" if kernel == "padded" else "sum of ranks"
            for what, fit in (("decode", model.decode), ("prefill", model.prefill)):
                size = "request" if what == "decode" else "token"
                lines.append(f"{kernel} {what}: {fit.points} points, R^2 {fit.r2:.3f}; {fit.alpha_s * 1e6:.3g} us "
                             f"per unit of {feature if what == 'decode' else 'tokens x rank'}, "
                             f"{fit.gamma_s * 1e6:.3g} us per {size}, {fit.beta_s * 1e3:.3g} ms fixed")
        cfg = engine.runner.cfg
        where = (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, ranks {list(sweep.ranks)}, "
                 f"{sweep.threads} torch thread(s), CPU")
    profile = LoraPerfProfile(name=name, description=f"`tidal profile lora`: {where}", **models)  # type: ignore[arg-type]
    return profile, [f"model: {where}", *lines]


__all__ = ["LoraSweep", "decode_batches", "prefill_sets", "profile_lora"]
