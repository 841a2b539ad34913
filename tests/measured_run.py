"""A made-up `tidal profile gpu` run (gpu_profile.DeviceRun) for tests of what consumes a measured profile."""
from __future__ import annotations

from loadgen.profiler.gpu_grids import plans
from loadgen.profiler.gpu_profile import DeviceRun, ModelRun
from loadgen.profiler.measure import StepSample
from loadgen.sim.profile import StepCost


def fake_run(cuda: bool = True) -> DeviceRun:
    """A device run as gpu_profile.py returns it, with made-up numbers (the build is pure)."""
    models = []
    for i, plan in enumerate(plans(cuda, quick=True)):
        step = StepCost(overhead_s=0.004 * (i + 1), decode_per_seq_s=1e-5, decode_per_ctx_token_s=2e-8,
                        prefill_per_token_s=2e-5, prefill_attn_s=1e-10)
        samples = [StepSample(b, b * c, 0, 0, step.step_s(b, b * c)) for b in (1, 8) for c in (512, 2048)]
        samples += [StepSample(0, 0, p, p * p, step.step_s(0, 0, p, p * p)) for p in (256, 2048)]
        models.append(ModelRun(plan, "random weights", samples, step, 0.0, 0.0, 32, 131072, 9000, 16, 4096,
                               16 << 30, 0.7 if i else None, 1.5, (0.05, "first step minus replays") if cuda else None))
    copies = {f"{d}_{k}": (rate, f"{d} {k} copy") for d, k, rate in
              (("h2d", "pinned", 50e9), ("h2d", "pageable", 20e9), ("d2h", "pinned", 48e9), ("d2h", "pageable", 9e9))}
    return DeviceRun("cuda:0" if cuda else "cpu", "NVIDIA H200", models, copies, (8e-6, "64-byte copy"),
                     (2e12, 131072, "block gather"), (0.002, 96 << 20, "adapter copy"), 60.0)
