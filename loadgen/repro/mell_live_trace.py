"""`tidal repro mell --live`: the trace that fragments KV, and the simulator's run of the same trace.

The trace (seeded, pure): two models, each with Poisson arrivals; a share of the requests is
*long* (a prompt of 60 % of a worker's KV), the rest *short* (10 %), outputs of about 5 %.
Output lengths are drawn uniformly around their mean, so requests leave in random order: the
load the dispatcher spread over a model's workers thins out unevenly, which is the
fragmentation MELL consolidates. Lengths are fractions of one worker's KV capacity (measured
on the live cluster), so the same spec stresses KV the same way whatever the pool size.

The simulation replays the SAME records through the planner core (`kv_packing_core.run_core`,
MELL in PlannerCore, arrivals routed by its placement hints), one simulated fleet per model
with as many devices as the model has live workers (more where a burst fits nowhere: the simulator
cannot queue a request, the live dispatcher does; the report says how many), on a schedule whose step times come from
the cost measured on the live cluster (`SimCost`). Its active devices per epoch are summed over
the models, so they compare with the live cluster's active workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.sim.kv_packing import build_schedule
from loadgen.sim.kv_packing_core import run_core
from loadgen.traces.schema import TraceRecord


@dataclass(frozen=True)
class LiveTraceSpec:
    models: tuple[str, ...] = ("mell-a", "mell-b")
    duration_s: float = 30.0
    rate_per_model: float = 0.8  # requests per second per model
    long_share: float = 0.2
    # fractions of one worker's KV capacity (tokens). KV is mostly prompt (cheap to prefill on a CPU), so
    # a few requests fill a worker while the generated tokens, the CPU's real work, stay few. A long
    # request is MELL's class L (over half a device at the 0.9 watermark), a short one class T.
    long_prompt: float = 0.60
    long_output: float = 0.05  # mean; each output is uniform in [0.5, 1.5] x its mean
    short_prompt: float = 0.10
    short_output: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.rate_per_model <= 0:
            raise ValueError(f"need duration_s > 0 and rate_per_model > 0, got {self.duration_s}, {self.rate_per_model}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        for kind, prompt, output in (("long", self.long_prompt, self.long_output),
                                     ("short", self.short_prompt, self.short_output)):
            if prompt <= 0 or output <= 0 or prompt + 1.5 * output >= 1:
                raise ValueError(f"a {kind} request must fit one worker's KV: need 0 < {kind}_prompt + 1.5 x "
                                 f"{kind}_output < 1, got {prompt} + 1.5 x {output}")


def fragmenting_trace(spec: LiveTraceSpec, capacity_tokens: int) -> list[TraceRecord]:
    """The records, in arrival order (ids `<model>-<n>`); lengths scale with `capacity_tokens`."""
    if capacity_tokens < 64:
        raise ValueError(f"a worker's KV holds {capacity_tokens} tokens: too few for this trace (need >= 64)")
    rng = np.random.default_rng(spec.seed)
    records: list[TraceRecord] = []
    for model in spec.models:
        t = 0.0
        n = 0
        while True:
            t += float(rng.exponential(1.0 / spec.rate_per_model))
            if t >= spec.duration_s:
                break
            long = bool(rng.random() < spec.long_share)
            prompt_f, output_f = (spec.long_prompt, spec.long_output) if long else (spec.short_prompt, spec.short_output)
            prompt = max(1, round(prompt_f * capacity_tokens))
            output = max(2, round(output_f * capacity_tokens * float(rng.uniform(0.5, 1.5))))
            records.append(TraceRecord(arrival_s=round(t, 4), model=model, prompt_tokens=prompt, output_tokens=output,
                                       request_id=f"{model}-{n}-{'long' if long else 'short'}"))
            n += 1
    records.sort(key=lambda r: (r.arrival_s, r.model))
    return records


@dataclass(frozen=True)
class SimCost:
    """What a live request's life costs, measured on the live cluster (`mell_live.probe_cost`)."""

    decode_step_s: float  # seconds per output token of a running request
    prefill_s_per_token: float


@dataclass(frozen=True)
class SimSide:
    active: np.ndarray  # active devices per epoch, summed over the models
    used_bytes: np.ndarray  # KV held per epoch, summed over the models
    migrations: int
    epoch_s: float
    capacity_bytes: int  # one device's KV (the live worker's, before the watermark)
    extra_devices: dict[str, int]  # model -> devices beyond its live workers the simulation needed (it cannot queue)

    def busy(self) -> np.ndarray:
        return self.active[self.active > 0]

    def utilisation(self) -> float:
        """KV in use over the active devices' KV, over the busy epochs."""
        provisioned = float(self.active.sum()) * self.capacity_bytes
        return float(self.used_bytes.sum()) / provisioned if provisioned else 0.0


def simulate(records: list[TraceRecord], *, devices: dict[str, int], capacity_bytes: int, bytes_per_token: int,
             block_tokens: int, watermark: float, epoch_s: float, cost: SimCost) -> SimSide:
    """Replay `records` per model through the planner core (MELL's capacity: `watermark` x a device's KV,
    as the live planner uses it); `devices`: model -> its live workers."""
    per_model = []
    extra: dict[str, int] = {}
    for model, n in sorted(devices.items()):
        mine = [r for r in records if r.model == model]
        if not mine:
            continue
        schedule = build_schedule(
            np.array([r.arrival_s for r in mine]), np.array([r.prompt_tokens for r in mine]),
            np.array([r.output_tokens for r in mine]), capacity=int(capacity_bytes * watermark),
            bytes_per_token=bytes_per_token, granule_tokens=block_tokens, epoch_s=epoch_s,
            prefill_s_per_token=cost.prefill_s_per_token, decode_step_s=cost.decode_step_s)
        for fleet in range(n, 4 * n + 1):  # the simulator cannot queue: a burst that fits nowhere needs a device more
            try:
                result = run_core(schedule, f"MELL-{model}", devices=fleet)
                break
            except RuntimeError as exc:
                if fleet == 4 * n:
                    raise RuntimeError(f"simulating {model} on up to {fleet} devices: {exc}") from None
        extra[model] = fleet - n
        per_model.append((result.active, schedule.used_bytes[: len(result.active)], result.moves))
    if not per_model:
        raise ValueError("the trace names none of the simulated models")
    length = max(len(a) for a, _u, _m in per_model)
    active = np.zeros(length, np.int64)
    used = np.zeros(length, np.int64)
    for a, u, _m in per_model:
        active[: len(a)] += a
        used[: len(u)] += u
    return SimSide(active=active, used_bytes=used, migrations=sum(m for _a, _u, m in per_model), epoch_s=epoch_s,
                   capacity_bytes=capacity_bytes, extra_devices=extra)


__all__ = ["LiveTraceSpec", "SimCost", "SimSide", "fragmenting_trace", "simulate"]
