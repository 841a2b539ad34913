"""A fleet's cost profile: GPUs, model mix and start-up costs, for the fleet simulator.

The profile file (loadgen/sim/profiles/fleet/*.toml) holds raw published quantities with
their sources; everything the simulator uses is derived here, so the arithmetic is tested:

    weights per GPU     = weights_bytes / tp
    roofline step(tp)   = weights per GPU / (hbm x eff) + 2 x layers x tp_allreduce_s  (tp > 1)
    decode step         = decode_step_s (measured at the model's own TP degree; another TP degree
                          scales it by roofline step(tp) / roofline step(parallel))
                          + per sequence 2 x params / (tp x flops x mfu)
                          + per context token kv_bytes_per_token / tp / (hbm x eff)
    prefill of n tokens = decode step + n x (prefill_s - decode_step_s) / prefill_tokens, so a
                          prompt of prefill_tokens takes the measured prefill_s (x parallel / tp)
    (a model without measured times: roofline step(tp) and 2 x params / (tp x flops x mfu) per
    prefill token)
    KV blocks           = (memory - reserved - weights per GPU) x tp / kv_bytes_per_token / block
    load (T_c)          = MovementCosts.load_s(weights per GPU): over the host link from host
                          memory, plus the disk link first where checkpoints are not in host
                          memory (the one movement cost model; the tp GPUs load in parallel)
    cold start          = hit_start_s + T_c; a prewarm hit starts in hit_start_s (the model's own
                          where its profile gives one, else the profile's)
                          (+ engine_init_s each, for a system without a pool of ready engines)

Memory- and compute-bound terms are summed (no overlap): a conservative roofline. A compute
share `share` < 1 (GPU sharing, MuxServe-like) divides every time by it.
"""
from __future__ import annotations

from pathlib import Path

import msgspec

from loadgen.sim.profile import ENGINE_MODES, LinkSpec, StepCost, WorkerSpec, active_measured
from loadgen.sim.profile_overlay import overlay_fleet
from shared.policy.movement import MovementCosts, MovementSpec, movement_costs
from shared.profiles import resolve_profile

FLEET_DIR = Path(__file__).with_name("profiles") / "fleet"
BLOCK_TOKENS = 16


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    memory_bytes: int
    reserved_bytes: int  # runtime, activations, engine: never weights or KV
    hbm_bytes_per_s: float
    bandwidth_efficiency: float
    fp16_flops: float
    mfu: float

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    @property
    def effective_bw(self) -> float:
        return self.hbm_bytes_per_s * self.bandwidth_efficiency


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The serving engine of every instance (loadgen/sim/engine_modes.py)."""

    mode: str = "chunked"  # "chunked" or "vllm-0.6"
    max_batched_tokens: int = 0  # per-step token budget (0: max(2048, max_model_len))
    watermark: float = 0.0


class StartupSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hit_start_s: float  # a new instance on prewarmed weights: until it can run its first step
    engine_init_s: float  # creating the serving engine on demand (systems without an engine pool)
    tp_allreduce_s: float  # one small all-reduce; a TP step does two per layer
    checkpoints_in_host_memory: bool = True  # else a cold load reads the disk link first


class FleetModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    weights_bytes: int
    params: int
    parallel: int  # GPUs one instance spans (tensor parallel)
    layers: int
    kv_bytes_per_token: int  # all layers, K and V, whole model
    max_model_len: int
    batch_size: int  # concurrent requests per instance (the autoscaler's B)
    decode_step_s: float = 0.0  # measured decode iteration of one request at `parallel` GPUs (0: roofline)
    prefill_s: float = 0.0  # measured prefill of `prefill_tokens` tokens
    prefill_tokens: int = 1024
    hit_start_s: float = 0.0  # this model's start on prewarmed weights (0: the profile's startup.hit_start_s)


class FleetProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str
    servers: int
    gpus_per_server: int
    gpu: GpuSpec
    startup: StartupSpec
    models: list[FleetModel]
    engine: EngineSpec = EngineSpec()
    links: list[LinkSpec]  # each GPU's own links (a load runs per GPU, in parallel across an instance's GPUs)
    movement: MovementSpec  # which link carries loads (host_link; disk_link where checkpoints start on disk)

    def movement_costs(self) -> MovementCosts:
        """The one movement cost model over this profile's links."""
        return movement_costs(self.movement, {link.name: link for link in self.links})

    @property
    def gpus(self) -> int:
        return self.servers * self.gpus_per_server

    def model(self, name: str) -> FleetModel:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"profile {self.name!r} has no model {name!r}; it has {[m.name for m in self.models]}")

    # --- derived costs ---------------------------------------------------------------------
    def weights_per_gpu(self, m: FleetModel, tp: int | None = None) -> int:
        return -(-m.weights_bytes // (tp or m.parallel))

    def _roofline_s(self, m: FleetModel, tp: int) -> float:
        comm = 2 * m.layers * self.startup.tp_allreduce_s if tp > 1 else 0.0
        return self.weights_per_gpu(m, tp) / self.gpu.effective_bw + comm

    def step_cost(self, m: FleetModel, tp: int | None = None, share: float = 1.0) -> StepCost:
        tp = tp or m.parallel
        if not 0 < share <= 1:
            raise ValueError(f"{m.name}: compute share must be in (0, 1], got {share}")
        bw, flops = self.gpu.effective_bw, self.gpu.fp16_flops * self.gpu.mfu
        per_token_flops_s = 2 * m.params / (tp * flops)
        if m.decode_step_s > 0:  # measured at its own TP degree
            overhead = m.decode_step_s * self._roofline_s(m, tp) / self._roofline_s(m, m.parallel)
            prefill = (m.prefill_s - m.decode_step_s) / m.prefill_tokens * m.parallel / tp
        else:
            overhead, prefill = self._roofline_s(m, tp), per_token_flops_s
        return StepCost(overhead_s=overhead / share, decode_per_seq_s=per_token_flops_s / share,
                        decode_per_ctx_token_s=m.kv_bytes_per_token / tp / bw / share,
                        prefill_per_token_s=prefill / share, prefill_attn_s=0.0)

    def request_s(self, m: FleetModel, prompt: int, output: int) -> float:
        """A request's time on an instance as the public code's trace generator charges it to find a
        model's concurrent load (trace_generator.py: prefill_time + GeneratedTokens x decode_time);
        a model without measured times: its prefill step, then `output` decode steps alone."""
        if m.decode_step_s > 0:
            return m.prefill_s + output * m.decode_step_s
        cost = self.step_cost(m)
        return cost.step_s(0, 0, prompt) + output * cost.step_s(1, prompt)

    def kv_blocks(self, m: FleetModel, tp: int | None = None) -> int:
        """KV blocks of an instance owning its `tp` GPUs whole."""
        tp = tp or m.parallel
        free = (self.gpu.usable_bytes - self.weights_per_gpu(m, tp)) * tp
        if free <= 0:
            raise ValueError(f"{m.name}: {self.weights_per_gpu(m, tp)} B of weights per GPU do not fit "
                             f"{self.gpu.usable_bytes} usable bytes")
        return free // (m.kv_bytes_per_token * BLOCK_TOKENS)

    def worker_spec(self, m: FleetModel, kv_blocks: int | None = None, max_batch: int | None = None) -> WorkerSpec:
        e = self.engine
        return WorkerSpec(kv_blocks=kv_blocks if kv_blocks is not None else self.kv_blocks(m),
                          block_size=BLOCK_TOKENS, kv_bytes_per_token=m.kv_bytes_per_token,
                          weights_bytes=m.weights_bytes, max_batch=max_batch or m.batch_size,
                          max_batched_tokens=e.max_batched_tokens or max(2048, m.max_model_len),
                          max_model_len=m.max_model_len, engine_mode=e.mode, watermark=e.watermark)

    def load_s(self, m: FleetModel, nbytes: int | None = None, *, in_host_memory: bool | None = None) -> float:
        """Loading `nbytes` per GPU (default: a whole replica's share, T_c), each GPU in parallel, from
        host memory or (in_host_memory False, default: the profile's setting) from disk first."""
        where = self.startup.checkpoints_in_host_memory if in_host_memory is None else in_host_memory
        return self.movement_costs().load_s(self.weights_per_gpu(m) if nbytes is None else nbytes,
                                            in_host_memory=where)

    def hit_start_s(self, engine_pool: bool = True, m: FleetModel | None = None) -> float:
        """A start on prewarmed weights: model m's own figure where its profile gives one, else the profile's."""
        own = m.hit_start_s if m is not None and m.hit_start_s > 0 else self.startup.hit_start_s
        return own + (0.0 if engine_pool else self.startup.engine_init_s)

    def cold_start_s(self, m: FleetModel, engine_pool: bool = True) -> float:
        return self.hit_start_s(engine_pool, m) + self.load_s(m)


def load_fleet_profile(source: str | Path) -> FleetProfile:
    """A fleet profile from a .toml file, or a built-in (loadgen/sim/profiles/fleet/) by name."""
    path = resolve_profile(source, FLEET_DIR)
    try:
        profile = msgspec.toml.decode(path.read_bytes(), type=FleetProfile)
    except OSError as exc:
        known = ", ".join(sorted(p.stem for p in FLEET_DIR.glob("*.toml")))
        raise ValueError(f"fleet profile {source}: cannot read ({exc.strerror}); built-ins: {known}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"fleet profile {path}: {exc}") from None
    if profile.servers < 1 or profile.gpus_per_server < 1 or not profile.models:
        raise ValueError(f"fleet profile {path}: need servers, gpus_per_server >= 1 and at least one model")
    try:
        costs = profile.movement_costs()
    except ValueError as exc:
        raise ValueError(f"fleet profile {path}: {exc}") from None
    if profile.engine.mode not in ENGINE_MODES or not 0 <= profile.engine.watermark < 1:
        raise ValueError(f"fleet profile {path}: engine.mode must be one of {', '.join(ENGINE_MODES)} and "
                         f"0 <= engine.watermark < 1")
    if not profile.startup.checkpoints_in_host_memory and costs.disk is None:
        raise ValueError(f"fleet profile {path}: checkpoints_in_host_memory is false but movement.disk_link is empty")
    for m in profile.models:
        if m.parallel > profile.gpus_per_server or m.batch_size < 1:
            raise ValueError(f"fleet profile {path}: model {m.name!r} needs 1 <= parallel <= gpus_per_server "
                             f"and batch_size >= 1")
        if m.decode_step_s < 0 or (m.decode_step_s > 0 and (m.prefill_s < m.decode_step_s or m.prefill_tokens < 1)):
            raise ValueError(f"fleet profile {path}: model {m.name!r} needs prefill_s >= decode_step_s > 0 "
                             f"and prefill_tokens >= 1 (or no measured times)")
        if not m.hit_start_s >= 0:
            raise ValueError(f"fleet profile {path}: model {m.name!r} needs hit_start_s >= 0 (0: the profile's)")
        profile.kv_blocks(m)  # raises when the weights do not fit
    measured = active_measured()  # `--profile FILE` of a repro: the device's numbers (loadgen/sim/measured_overlay.py)
    return overlay_fleet(profile, measured) if measured is not None else profile
