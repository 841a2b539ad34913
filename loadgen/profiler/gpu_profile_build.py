"""A `DeviceRun` (gpu_profile.py) as the simulator's `CostProfile`, one `FieldSource` per number.

The profile's `step` is the 8B geometry's fitted step (the size the papers serve); `models` holds
each profiled model's step under its name. Links: `h2d` and `d2h` are the page-locked rates (what
a host-resident copy of weights, adapters or dropped layers loads at), `h2d-pageable` and
`d2h-pageable` beside them, `kv-copy` the device's KV block gather; `movement` carries host loads
over `h2d` and KV moves over `kv-copy` (no disk: checkpoints are in host memory). Settings of the
run (batch cap, step budget) are marked `setting`; the per-request overhead is `cited`. Pure.
"""
from __future__ import annotations

from loadgen.profiler.gpu_grids import geometry
from loadgen.profiler.gpu_profile import DeviceRun, ModelRun
from loadgen.sim.profile import CostProfile, LinkSpec, MovementSpec, StepCost, WorkerSpec
from loadgen.sim.profile_sources import (DeviceMeasures, FieldSource, MeasuredPoint, ModelFit, cited, measured,
                                         setting, unmeasured)

# The fit's median relative error over its points that a run is held to: on a GPU steps repeat to a few
# percent; the CPU run's test shares a 2-core host with other work, whose noise the CPU clock only narrows.
FIT_TOLERANCE = {"cuda": 0.10, "cpu": 0.35}
REQUEST_OVERHEAD_S = 0.002


def _fit(m: ModelRun) -> ModelFit:
    geo = geometry(m.plan.shape, m.plan.dtype) + (f" ({m.plan.reduced})" if m.plan.reduced else "")
    return ModelFit(geometry=f"{geo}; {m.weights_from}", grid=m.plan.grid.describe(),
                    points=[MeasuredPoint(decode_seqs=s.decode_seqs, decode_ctx=s.decode_ctx,
                                          prefill_tokens=s.prefill_tokens, prefill_attn=s.prefill_attn,
                                          seconds=s.seconds) for s in m.samples],
                    median_error=m.median_error, max_error=m.max_error)


def _step_sources(prefix: str, m: ModelRun, device: str) -> dict[str, FieldSource]:
    clock = "wall" if device.endswith("(cuda)") or "cuda" in device else "CPU-clock (1 thread)"
    how = (f"least-squares fit (relative error, coefficients >= 0; loadgen/profiler/fit.py) to {len(m.samples)} "
           f"LLMEngine.step() {clock} times of {m.plan.name} on {device}: {m.plan.grid.describe()}; fit error median "
           f"{m.median_error:.1%}, max {m.max_error:.1%}" + (f"; {m.plan.reduced}" if m.plan.reduced else ""))
    return {f"{prefix}.{f}": measured(how) for f in StepCost.__struct_fields__}


def build_profile(run: DeviceRun, *, name: str, command: str, date: str) -> CostProfile:
    big = run.models[-1]
    dev = f"{run.device_name} ({run.device})"
    src: dict[str, FieldSource] = {"request_overhead_s": cited(
        "gateway + dispatch + delivery per request: the simulator's default (loadgen/sim/profile.py), not measured here")}
    src.update(_step_sources("step", big, dev))
    for m in run.models:
        src.update(_step_sources(f"models.{m.plan.name}", m, dev))
    pool = "CUDA: 90% of free HBM after the weights" if run.device.startswith("cuda") else "CPU: 2x weights + 1 GiB"
    src["worker.kv_blocks"] = measured(f"the engine's KV blocks for {big.plan.name} on {dev} ({pool}), in blocks "
                                       f"of every layer")
    src["worker.kv_bytes_per_token"] = measured(f"the engine's KV block bytes x {big.layers} layers / block size")
    src["worker.weights_bytes"] = measured(f"the bytes of {big.plan.name}'s weights as the engine holds them")
    for key in ("block_size", "max_batch", "max_batched_tokens", "max_model_len"):
        src[f"worker.{key}"] = setting("the profile run's engine setting (its grid's largest batch and prompt)")
    c = run.copies
    links = [LinkSpec(name="h2d", latency_s=run.latency[0], bandwidth_bytes_per_s=c["h2d_pinned"][0]),
             LinkSpec(name="d2h", latency_s=run.latency[0], bandwidth_bytes_per_s=c["d2h_pinned"][0]),
             LinkSpec(name="h2d-pageable", latency_s=run.latency[0], bandwidth_bytes_per_s=c["h2d_pageable"][0]),
             LinkSpec(name="d2h-pageable", latency_s=run.latency[0], bandwidth_bytes_per_s=c["d2h_pageable"][0]),
             LinkSpec(name="kv-copy", latency_s=run.latency[0], bandwidth_bytes_per_s=run.kv_copy[0])]
    for link, key in (("h2d", "h2d_pinned"), ("d2h", "d2h_pinned"), ("h2d-pageable", "h2d_pageable"),
                      ("d2h-pageable", "d2h_pageable")):
        src[f"links.{link}.bandwidth_bytes_per_s"] = measured(c[key][1])
    src["links.kv-copy.bandwidth_bytes_per_s"] = measured(run.kv_copy[2])
    src["links.*.latency_s"] = measured(run.latency[1])
    adapter_s, adapter_bytes, adapter_how = run.adapter
    src["worker.adapter_load_s"] = measured(adapter_how)
    src["movement"] = setting("host loads over h2d (page-locked), KV moves over kv-copy, no disk link")
    worker = WorkerSpec(kv_blocks=max(1, big.kv_blocks), block_size=big.block_size,
                        kv_bytes_per_token=big.kv_block_bytes * big.layers // big.block_size,
                        weights_bytes=big.weights_bytes, max_batch=big.plan.grid.max_batch,
                        max_batched_tokens=big.plan.grid.budget, max_model_len=big.max_model_len,
                        adapter_load_s=adapter_s)
    assert big.weights_load_s is not None  # the 8B geometry is generated, so its load is timed
    cuda = run.device.startswith("cuda")
    src["device.weights_load_s"] = measured(
        f"{big.weights_bytes / 2**30:.2f} GiB of {big.plan.name} weights, "
        + (f"page-locked host memory -> {dev}, one synchronized pass" if cuda else
           "a host memory copy (no device on a CPU: memcpy, not a load over a link)"))
    src["device.engine_start_s"] = measured(f"LLMEngine construction on {big.plan.name}'s weights already on the "
                                            f"device (KV region, scheduler, runner), {dev}")
    if big.graph_capture is not None:
        src["device.graph_capture_s"] = measured(big.graph_capture[1])
    else:
        src["device.graph_capture_s"] = unmeasured("no CUDA graphs on a CPU: null until a GPU run")
    src["device.adapter_load_s"] = measured(adapter_how)
    src["device.kv_block_copy_bytes_per_s"] = measured(run.kv_copy[2])
    device = DeviceMeasures(
        device=run.device_name, date=date, command=command,
        h2d_pageable_bytes_per_s=c["h2d_pageable"][0], h2d_pinned_bytes_per_s=c["h2d_pinned"][0],
        d2h_pageable_bytes_per_s=c["d2h_pageable"][0], d2h_pinned_bytes_per_s=c["d2h_pinned"][0],
        kv_block_copy_bytes_per_s=run.kv_copy[0], kv_block_bytes=run.kv_copy[1], weights_bytes=big.weights_bytes,
        weights_load_s=big.weights_load_s, engine_start_s=big.engine_start_s, adapter_bytes=adapter_bytes,
        adapter_load_s=adapter_s, graph_capture_s=big.graph_capture[0] if big.graph_capture else None,
        fits={m.plan.name: _fit(m) for m in run.models})
    return CostProfile(
        name=name, description=f"measured by `tidal profile gpu` on {dev}, {date}; step = {big.plan.name}",
        request_overhead_s=REQUEST_OVERHEAD_S, step=big.step, worker=worker, links=links,
        models={m.plan.name: m.step for m in run.models},
        movement=MovementSpec(kv_link="kv-copy", host_link="h2d", disk_link=""), sources=src, device=device)


def summary_line(profile: CostProfile) -> str:
    from loadgen.sim.profile_sources import count_sources

    fields, n_measured = count_sources(profile.sources)
    fits = profile.device.fits if profile.device else {}
    worst = max((f.median_error for f in fits.values()), default=0.0)
    return f"profile gpu: fields={fields} measured={n_measured} fit_median_err={100 * worst:.0f}%"


__all__ = ["FIT_TOLERANCE", "build_profile", "summary_line"]
