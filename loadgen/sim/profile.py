"""Cost models of the simulator, read from a profile file (TOML or JSON).

One engine step (continuous batching with chunked prefill) takes

    overhead_s
    + decode_per_seq_s * (sequences decoding this step)
    + decode_per_ctx_token_s * (their context tokens, summed)
    + prefill_per_token_s * (prefill tokens this step)
    + prefill_attn_s * sum over prefill chunks of (chunk tokens x context after the chunk)

seconds; a decode-only step has no prefill terms, a prefill-only step no decode terms.
A transfer of `n` bytes over a link takes `latency_s + n / bandwidth_bytes_per_s`.
`tidal profile` fits these coefficients from the real engine; the defaults (the
built-in `cpu` profile) are plausible numbers for a ~0.5B model on a few CPU cores.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import msgspec

from loadgen.sim.profile_overlay import overlay_cost
from loadgen.sim.profile_sources import DeviceMeasures, FieldSource
from shared.policy.movement import LinkSpec, MovementCosts, MovementSpec, movement_costs  # LinkSpec: re-exported


ENGINE_MODES = ("chunked", "vllm-0.6")


class StepCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    overhead_s: float = 0.02
    decode_per_seq_s: float = 0.002
    decode_per_ctx_token_s: float = 5e-7
    prefill_per_token_s: float = 5e-4
    prefill_attn_s: float = 2e-9

    def step_s(self, decode_seqs: int, decode_ctx: int, prefill_tokens: int = 0, prefill_attn: int = 0) -> float:
        return (self.overhead_s + self.decode_per_seq_s * decode_seqs + self.decode_per_ctx_token_s * decode_ctx
                + self.prefill_per_token_s * prefill_tokens + self.prefill_attn_s * prefill_attn)


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One worker: one instance of one model, its KV budget and batching limits."""

    kv_blocks: int = 2048
    block_size: int = 16  # tokens per KV block
    kv_bytes_per_token: int = 12_288  # all layers' K and V of one token
    weights_bytes: int = 1_000_000_000
    max_batch: int = 32  # sequences in the batch (KunServe §4.3's maximum batch)
    max_batched_tokens: int = 512  # per-step token budget: decode tokens + prefill chunks
    max_prefill_chunk: int = 0  # 0: a chunk may take the whole remaining budget
    max_model_len: int = 8192  # prompt + output
    max_resident_adapters: int = 16  # LoRA adapters held at once (LRU beyond that)
    # A flat load per cold adapter, delaying the step that admits it: what the generic SimWorker charges
    # (`tidal sim`, the live repros' Cached comparison). LoraSimWorker with adapter load times (the
    # CaraServe repro) charges MovementCosts.load_s of each adapter's bytes instead.
    adapter_load_s: float = 0.02
    # How the engine builds a step (loadgen/sim/engine_modes.py): "chunked" is our engine's
    # scheduler (decodes first, then prefill chunks within the token budget); "vllm-0.6" is what
    # the papers' baselines ran (prefill-first, whole prompts, recompute preemption).
    engine_mode: str = "chunked"
    watermark: float = 0.0  # vLLM's admission watermark: free blocks kept back (0.01 in vllm-0.6)


def _default_links() -> list[LinkSpec]:
    return [LinkSpec(name="tcp", latency_s=1e-4, bandwidth_bytes_per_s=1.25e9),
            LinkSpec(name="shm", latency_s=1e-5, bandwidth_bytes_per_s=8e9),
            LinkSpec(name="disk", latency_s=1e-4, bandwidth_bytes_per_s=1e9)]


class CostProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "cpu"
    description: str = "plausible numbers for a ~0.5B model on a few CPU cores"
    request_overhead_s: float = 0.002  # gateway, dispatch and token delivery, once per request
    # an instance's start, from the decision to serving: the checkpoint read and the engine built
    # (`tidal profile` times it); 0: not measured (scale-out then charges the disk link's read of the weights)
    instance_start_s: float = 0.0
    step: StepCost = StepCost()
    worker: WorkerSpec = WorkerSpec()
    links: list[LinkSpec] = msgspec.field(default_factory=_default_links)
    models: dict[str, StepCost] = {}  # per-model step costs; others use `step`
    movement: MovementSpec = MovementSpec()  # which link moves what (shared/policy/movement.py)
    # `tidal profile gpu`: how each number was obtained ("step.overhead_s" -> measured / cited / unmeasured)
    # and the device facts beside them (loadgen/sim/profile_sources.py); empty / None in a cited profile
    sources: dict[str, FieldSource] = {}
    device: DeviceMeasures | None = None

    def start_s(self) -> float:
        """An instance's start: the measured one, else the weights read over the disk link."""
        if self.instance_start_s > 0:
            return self.instance_start_s
        return self.transfer_s(self.worker.weights_bytes, self.movement.disk_link)

    def movement_costs(self) -> MovementCosts:
        """The one movement cost model (migrations, restores, loads) over this profile's links."""
        return movement_costs(self.movement, {link.name: link for link in self.links})

    def step_cost(self, model: str) -> StepCost:
        return self.models.get(model, self.step)

    def link(self, name: str) -> LinkSpec:
        for link in self.links:
            if link.name == name:
                return link
        raise KeyError(f"profile {self.name!r} has no link {name!r}; it has {[l.name for l in self.links]}")

    def transfer_s(self, nbytes: int, link: str) -> float:
        return self.link(link).transfer_s(nbytes)


BUILTIN_DIR = Path(__file__).with_name("profiles")


MEASURED_ENV = "TIDAL_MEASURED_PROFILE"  # a measured profile laid over every profile loaded (measured_overlay.py)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in [*BUILTIN_DIR.glob("*.toml"), *BUILTIN_DIR.glob("*.json")])


@lru_cache(maxsize=4)
def load_measured(path: str) -> CostProfile:
    """A profile written by `tidal profile gpu` (it must carry its device measures and sources)."""
    profile = load_profile(path, overlay=False)
    if profile.device is None or not profile.sources:
        raise ValueError(f"{path} is not a measured profile (no device measures or sources): "
                         "write one with `tidal profile gpu`")
    return profile


def active_measured() -> CostProfile | None:
    path = os.environ.get(MEASURED_ENV)
    return load_measured(path) if path else None


def load_profile(source: str | Path | None = None, *, overlay: bool = True) -> CostProfile:
    """A profile from a .toml/.json file, or a built-in by name; None gives the defaults. With a
    measured profile active (MEASURED_ENV) its device numbers replace the cited ones."""
    if source is None:
        return CostProfile()
    path = Path(source)
    for suffix in (".toml", ".json"):
        if not path.exists() and (BUILTIN_DIR / f"{source}{suffix}").exists():
            path = BUILTIN_DIR / f"{source}{suffix}"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"profile {source}: cannot read ({exc.strerror}); built-ins: {', '.join(builtin_profiles())}") from None
    try:
        if path.suffix == ".json":
            profile = msgspec.json.decode(data, type=CostProfile)
        else:
            profile = msgspec.toml.decode(data, type=CostProfile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"profile {path}: {exc}") from None
    _validate(profile, path)
    measured = active_measured() if overlay else None
    return overlay_cost(profile, measured) if measured is not None else profile


def _validate(p: CostProfile, path: Path) -> None:
    w = p.worker
    if w.kv_blocks < 1 or w.block_size < 1 or w.max_batch < 1 or w.max_batched_tokens < w.max_batch:
        raise ValueError(f"profile {path}: need kv_blocks, block_size, max_batch >= 1 and "
                         f"max_batched_tokens >= max_batch")
    if w.engine_mode not in ENGINE_MODES:
        raise ValueError(f"profile {path}: worker.engine_mode {w.engine_mode!r} is not one of {', '.join(ENGINE_MODES)}")
    if not 0 <= w.watermark < 1:
        raise ValueError(f"profile {path}: worker.watermark must be in [0, 1), got {w.watermark}")
    try:
        p.movement_costs()
    except ValueError as exc:
        raise ValueError(f"profile {path}: {exc}") from None
    for name, cost in [("step", p.step), *p.models.items()]:
        if min(msgspec.structs.astuple(cost)) < 0 or cost.step_s(1, 1) <= 0:
            raise ValueError(f"profile {path}: step cost {name!r} needs non-negative coefficients and a step > 0")


def save_profile(path: str | Path, profile: CostProfile) -> Path:
    """JSON (TOML is read, not written: the standard library has no TOML writer)."""
    path = Path(path)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(profile)) + b"\n")
    return path
