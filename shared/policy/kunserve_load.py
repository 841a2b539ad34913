"""What KunServe's drop plan and monitor know of one model instance, and its KV demand 1 s ahead.

§4.3: the monitor checks "used KVCache vs. available HBM" and projects both with "the increase
rate of KVCache requirements and the change rate of available HBM"; like Llumnix (§2.2) the
demand counts the running requests and the queued ones. So an instance's projected demand
`horizon_s` ahead is

    kv_used + max(0, kv_growth_per_s) x horizon + queued_kv            (bytes)

against a capacity of  kv_capacity + capacity_change_per_s x horizon. `from_instance_stats`
builds an `InstanceLoad` from the wire (`WorkerStats.instances[]` and the catalog's
`ModelRecord`). Pure: no I/O, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.events.registry import ModelRecord
from shared.events.worker import InstanceStats

DEFAULT_HORIZON_S = 1.0  # §4.3: "exceed the available HBM in one second"


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    instance_id: str
    worker_id: str
    model: str
    num_layers: int  # decoder layers of the model
    layer_bytes: int  # one decoder layer's weights: what dropping it frees
    kv_capacity_bytes: int  # KV it can hold now (its blocks, used or free)
    kv_used_bytes: int = 0
    kv_growth_bytes_per_s: float = 0.0  # running requests' KV growth (negative: shrinking)
    queued_kv_bytes: int = 0  # KV the queued requests need when admitted (their prompts)
    capacity_change_bytes_per_s: float = 0.0  # available HBM trend (a restore or a prewarm shrinks it)
    kept_layers: tuple[int, int] | None = None  # [start, end) it keeps when already in a group
    group_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "layer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"instance {self.instance_id}: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_capacity_bytes", "kv_used_bytes", "queued_kv_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"instance {self.instance_id}: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def param_bytes(self) -> int:
        """P of §4.1: the decoder layers' weights (embeddings and head are never dropped)."""
        return self.num_layers * self.layer_bytes

    @property
    def grouped(self) -> bool:
        return self.group_id is not None

    @property
    def dropped_bytes(self) -> int:
        """Weights it has already given to KV (0 when unsplit)."""
        if self.kept_layers is None:
            return 0
        start, end = self.kept_layers
        return (self.num_layers - (end - start)) * self.layer_bytes

    def projected_demand(self, horizon_s: float = DEFAULT_HORIZON_S) -> float:
        return self.kv_used_bytes + max(0.0, self.kv_growth_bytes_per_s) * horizon_s + self.queued_kv_bytes

    def projected_capacity(self, horizon_s: float = DEFAULT_HORIZON_S) -> float:
        return max(0.0, self.kv_capacity_bytes + self.capacity_change_bytes_per_s * horizon_s)

    def deficit(self, horizon_s: float = DEFAULT_HORIZON_S, target_usage: float = 1.0) -> float:
        """Bytes it lacks to hold its projected demand at `target_usage` of its capacity (0 if none)."""
        return max(0.0, self.projected_demand(horizon_s) - target_usage * self.projected_capacity(horizon_s))


def total_deficit(loads: list[InstanceLoad] | tuple[InstanceLoad, ...], horizon_s: float = DEFAULT_HORIZON_S,
                  target_usage: float = 1.0) -> int:
    """R of §4.1: the additional memory the instances need, summed per instance (KV cannot move
    between instances for free, so one's spare room does not cover another's shortfall)."""
    if not 0 < target_usage <= 1:
        raise ValueError(f"target_usage must be in (0, 1], got {target_usage}")
    return int(-(-sum(load.deficit(horizon_s, target_usage) for load in loads) // 1))  # ceil


def from_instance_stats(stats: InstanceStats, *, worker_id: str, model: ModelRecord, kv_block_tokens: int,
                        kv_bytes_per_token: int | None = None) -> InstanceLoad:
    """An `InstanceLoad` from a worker's stats and the catalog. Queued KV is the queued prompt
    tokens' KV; bytes per token come from the block size unless given."""
    if stats.model != model.name:
        raise ValueError(f"instance {stats.instance_id} serves {stats.model!r}, not {model.name!r}")
    if model.layer_bytes < 1:
        raise ValueError(f"model {model.name!r} has no layer_bytes in the catalog: the drop plan needs it")
    if kv_block_tokens < 1:
        raise ValueError(f"kv_block_tokens must be >= 1, got {kv_block_tokens}")
    per_token = kv_bytes_per_token if kv_bytes_per_token is not None else stats.kv_block_bytes // kv_block_tokens
    kept = (stats.layers.start, stats.layers.end)
    return InstanceLoad(
        instance_id=stats.instance_id, worker_id=worker_id, model=stats.model, num_layers=model.num_layers,
        layer_bytes=model.layer_bytes, kv_capacity_bytes=stats.kv_blocks_total * stats.kv_block_bytes,
        kv_used_bytes=stats.kv_blocks_used * stats.kv_block_bytes,
        kv_growth_bytes_per_s=stats.kv_growth_blocks_per_s * stats.kv_block_bytes,
        queued_kv_bytes=stats.queued_prompt_tokens * per_token,
        kept_layers=None if kept == (0, model.num_layers) else kept, group_id=stats.group_id)


__all__ = ["DEFAULT_HORIZON_S", "InstanceLoad", "from_instance_stats", "total_deficit"]
