"""Where a cost profile's numbers come from, and what a device run measured beside them.

A profile written by `tidal profile gpu` (loadgen/profiler/gpu_profile.py) carries, beside the
simulator's coefficients, one `FieldSource` per number it holds: `measured` with the method
(what was timed, over which grid, on which device), `cited` with the reference, `setting` for a
choice of the run (the engine's batch cap), or `unmeasured` with the reason the number is absent
(CUDA-graph capture on a CPU). `DeviceMeasures` holds the
device facts the simulator's step model has no slot for (load and start times, copy rates, the
measured points the step fit was made from), so a report can show them and a test can check
the fit against the points. Pure: no I/O.
"""
from __future__ import annotations

import msgspec

SOURCE_KINDS = ("measured", "cited", "setting", "unmeasured")


class FieldSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: str  # one of SOURCE_KINDS
    method: str  # measured: how (tool, grid, device); cited: the reference; setting: what; unmeasured: why

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"source kind {self.kind!r} is not one of {', '.join(SOURCE_KINDS)}")
        if not self.method.strip():
            raise ValueError("a field source needs its method, reference or reason")


def measured(method: str) -> FieldSource:
    return FieldSource(kind="measured", method=method)


def cited(reference: str) -> FieldSource:
    return FieldSource(kind="cited", method=reference)


def setting(what: str) -> FieldSource:
    return FieldSource(kind="setting", method=what)


def unmeasured(reason: str) -> FieldSource:
    return FieldSource(kind="unmeasured", method=reason)


class MeasuredPoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One timed step, in the step model's features (`StepCost.step_s` arguments)."""

    decode_seqs: int
    decode_ctx: int
    prefill_tokens: int
    prefill_attn: int
    seconds: float


class ModelFit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model's step-time grid and how well the fitted `StepCost` reproduces it."""

    geometry: str  # layers, hidden, heads, vocab, dtype; and what was reduced for the run
    grid: str  # the (batch, context) and prompt grids timed
    points: list[MeasuredPoint]
    median_error: float  # relative, over the points
    max_error: float


class DeviceMeasures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: str  # as the runtime names it (torch.cuda.get_device_name, or the CPU)
    date: str  # UTC, ISO 8601
    command: str
    h2d_pageable_bytes_per_s: float
    h2d_pinned_bytes_per_s: float
    d2h_pageable_bytes_per_s: float
    d2h_pinned_bytes_per_s: float
    kv_block_copy_bytes_per_s: float  # gather of scattered KV blocks into another region (swap/migration)
    kv_block_bytes: int
    weights_bytes: int
    weights_load_s: float  # host memory -> device, every weight of the large model
    engine_start_s: float  # LLMEngine construction on weights already on the device
    adapter_bytes: int
    adapter_load_s: float  # a 32-layer rank-64 q,k,v adapter, host memory -> device
    graph_capture_s: float | None  # one decode-bucket CUDA graph; None on a CPU
    fits: dict[str, ModelFit] = {}


def count_sources(sources: dict[str, FieldSource]) -> tuple[int, int]:
    """(fields, measured fields)."""
    return len(sources), sum(1 for s in sources.values() if s.kind == "measured")


def source_lines(sources: dict[str, FieldSource]) -> list[str]:
    """`- fields: kind — method` lines, fields sharing a source on one line, measured first."""
    order = {k: i for i, k in enumerate(SOURCE_KINDS)}
    groups: dict[FieldSource, list[str]] = {}
    for name, src in sources.items():
        groups.setdefault(src, []).append(name)
    rows = sorted(groups.items(), key=lambda kv: (order[kv[0].kind], min(kv[1])))
    return [f"- {', '.join(f'`{n}`' for n in sorted(names))}: {src.kind} — {src.method}" for src, names in rows]


__all__ = ["DeviceMeasures", "FieldSource", "MeasuredPoint", "ModelFit", "SOURCE_KINDS", "cited",
           "count_sources", "measured", "setting", "source_lines", "unmeasured"]
