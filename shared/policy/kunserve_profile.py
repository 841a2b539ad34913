"""KunServe's cost model of pipeline overhead: what a buddy group of k instances yields, by k.

§4.1 writes the plan's cost as  Cost = Thpt_I x N / sum_i Thpt_g(|group i|),  with Thpt_I (one
unsplit instance) and Thpt_g(k) (a k-stage pipeline) "profiled offline". A `PipelineProfile`
holds, per stage count k = 1..max_stages, `throughput_efficiency` = Thpt_g(k) / (k x Thpt_I)
(so a group of k instances serves k x efficiency instances' worth) and the latency inflation
that goes with it. The drop plan relies on one property and this module enforces it: the
efficiency never rises with k (more stages, more bubbles: §3, §4.1), which makes "as few
instances per group as the memory needs" the throughput-optimal plan.

Pure: `decode_pipeline_profile` takes the file's bytes; reading the file is the caller's
(`shared.profiles.load_pipeline_profile`). The default profile, with the published numbers it
comes from, is `shared/profiles/kunserve-qwen2.5-14b-a800.toml`.
"""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

MAX_STAGES = 64  # a FormGroup holds at most 64 members


class StageOverhead(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A k-stage buddy group against k unsplit instances."""

    stages: Annotated[int, Meta(ge=1, le=MAX_STAGES)]
    throughput_efficiency: Annotated[float, Meta(gt=0, le=1)]  # Thpt_g(k) / (k x Thpt_I)
    tbt_factor: Annotated[float, Meta(ge=1)] = 1.0  # time between tokens over an unsplit instance's
    ttft_factor: Annotated[float, Meta(ge=1)] = 1.0  # time to first token over an unsplit instance's
    source: Annotated[str, Meta(min_length=1, max_length=512)]  # where the numbers come from


class PipelineProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    description: str = ""
    stages: Annotated[list[StageOverhead], Meta(min_length=1, max_length=MAX_STAGES)]

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def max_stages(self) -> int:
        return len(self.stages)

    def overhead(self, stages: int) -> StageOverhead:
        if not 1 <= stages <= self.max_stages:
            raise ValueError(f"pipeline profile {self.name!r} covers 1..{self.max_stages} stages, not {stages}")
        return self.stages[stages - 1]

    def efficiency(self, stages: int) -> float:
        return self.overhead(stages).throughput_efficiency

    def group_throughput(self, stages: int) -> float:
        """Thpt_g(k) / Thpt_I: a k-member group's throughput in unsplit-instance units."""
        return stages * self.efficiency(stages)

    def throughput(self, group_sizes: list[int] | tuple[int, ...]) -> float:
        """sum_i Thpt_g(|group i|) / Thpt_I over a whole configuration."""
        return sum(self.group_throughput(k) for k in group_sizes)

    def cost(self, group_sizes: list[int] | tuple[int, ...]) -> float:
        """§4.1's Cost: unsplit throughput over grouped throughput (1.0 = no loss; higher = worse)."""
        return sum(group_sizes) / self.throughput(group_sizes)


def _validate(p: PipelineProfile) -> None:
    for i, entry in enumerate(p.stages):
        if entry.stages != i + 1:
            raise ValueError(f"pipeline profile {p.name!r}: entry {i} is for {entry.stages} stages; the entries "
                             f"must cover 1, 2, ... in order, got {[e.stages for e in p.stages]}")
        if not 0 < entry.throughput_efficiency <= 1:
            raise ValueError(f"pipeline profile {p.name!r}: {entry.stages} stages: throughput_efficiency must be "
                             f"in (0, 1], got {entry.throughput_efficiency}")
    if p.stages[0].throughput_efficiency != 1.0:
        raise ValueError(f"pipeline profile {p.name!r}: 1 stage is an unsplit instance, its throughput_efficiency "
                         f"must be 1.0, got {p.stages[0].throughput_efficiency}")
    for a, b in zip(p.stages, p.stages[1:]):
        if b.throughput_efficiency > a.throughput_efficiency:
            raise ValueError(f"pipeline profile {p.name!r}: throughput_efficiency rises from {a.stages} to "
                             f"{b.stages} stages ({a.throughput_efficiency} -> {b.throughput_efficiency}); "
                             f"a deeper pipeline never has fewer bubbles")


def decode_pipeline_profile(data: bytes | str, *, origin: str = "<profile>", fmt: str = "toml") -> PipelineProfile:
    """A profile from TOML (or JSON) text; a clear ValueError naming `origin` when it is wrong."""
    try:
        if fmt == "json":
            return msgspec.json.decode(data, type=PipelineProfile)
        if fmt == "toml":
            return msgspec.toml.decode(data, type=PipelineProfile)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"pipeline profile {origin}: {exc}") from None
    raise ValueError(f"pipeline profile {origin}: format must be 'toml' or 'json', got {fmt!r}")


__all__ = ["MAX_STAGES", "PipelineProfile", "StageOverhead", "decode_pipeline_profile"]
