"""What moving memory costs: one model for every byte the cluster moves, shared by the simulator
(every repro) and the planner's policies. Pure: numbers in, seconds out.

- KV migration as Llumnix does it (Sun et al., OSDI'24 §4.2; its code's defaults: at most 3 stages,
  a last stage of at most 16 blocks): the destination reserves the blocks first and holds them for
  the whole copy; stage 1 copies every block while the request keeps decoding on the source, each
  later stage copies the blocks written meanwhile; once what is left fits in the last stage, the
  request stops on the source (the stall), the rest is copied, and it resumes on the destination.
  It fails (aborts, the reservation is released) when a stage does not converge within the stage
  limit, when the destination cannot reserve the blocks, or when the request ends or is preempted
  on the source before the hand-over.
- Token-mode migration: no bytes move, the destination re-prefills the context: its cost is the
  destination's prefill compute for that many tokens (the simulator queues it as a prefill).
- Layer drop is free (the bytes are given to KV in place); restoring dropped layers copies them
  back over the host link (or from a peer over the KV link).
- Adapter and model loads: over the host link from host memory, plus the disk link when the bytes
  are not in host memory yet.
Every link is a `Link` (latency + bytes / bandwidth); profiles name which link is which and cite
where each bandwidth comes from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec


class Link(Protocol):
    latency_s: float
    bandwidth_bytes_per_s: float

    def transfer_s(self, nbytes: int) -> float: ...


class LinkSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One link of a cost profile (`[[links]]`): a transfer of n bytes takes latency_s + n / bandwidth."""

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class MovementSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which of a profile's links carries what, and Llumnix's migration limits."""

    kv_link: str = "tcp"  # instance <-> instance: KV migration and exchange, activations
    host_link: str = "shm"  # host memory <-> device: dropped layers, adapters, weights kept in host memory
    disk_link: str = "disk"  # checkpoint storage -> host memory ("" where the profile models no disk)
    migration_max_stages: int = 3  # Llumnix: abort a migration that needs more pre-copy stages
    migration_last_stage_max_blocks: int = 16  # Llumnix: stop the request once at most this many blocks are left

    def __post_init__(self) -> None:
        if self.migration_max_stages < 1 or self.migration_last_stage_max_blocks < 0:
            raise ValueError("movement: migration_max_stages must be >= 1 and migration_last_stage_max_blocks >= 0")


class Precopy(msgspec.Struct, frozen=True, kw_only=True):
    """One KV migration's timeline (seconds from its start)."""

    ok: bool
    stages: int
    precopy_s: float  # stages copied while the request kept decoding on the source
    stall_s: float  # the last stage: the request runs nowhere
    blocks: int  # blocks the destination holds by the hand-over
    reason: str = ""  # why it failed

    @property
    def total_s(self) -> float:
        return self.precopy_s + self.stall_s


@dataclass(frozen=True)
class MovementCosts:
    spec: MovementSpec
    kv: Link
    host: Link
    disk: Link | None

    def kv_precopy(self, ctx_tokens: int, block_size: int, block_bytes: int, decode_step_s: float) -> Precopy:
        """Llumnix's multi-stage pre-copy of a request with `ctx_tokens` of KV that keeps decoding
        one token per `decode_step_s` on the source while stages are copied."""
        if ctx_tokens < 1 or block_size < 1 or block_bytes < 1:
            raise ValueError(f"kv_precopy: ctx_tokens, block_size and block_bytes must be >= 1 "
                             f"(got {ctx_tokens}, {block_size}, {block_bytes})")
        copied, tokens, t = 0, float(ctx_tokens), 0.0
        pending = -(-ctx_tokens // block_size)
        for stage in range(1, self.spec.migration_max_stages + 1):
            if pending <= self.spec.migration_last_stage_max_blocks:
                stall = self.kv.transfer_s(pending * block_bytes)
                return Precopy(ok=True, stages=stage, precopy_s=t, stall_s=stall, blocks=copied + pending)
            dt = self.kv.transfer_s(pending * block_bytes)
            t += dt
            copied += pending
            tokens += dt / decode_step_s if decode_step_s > 0 else 0.0
            pending = max(0, -(-int(tokens) // block_size) - copied + 1)  # the partly written block goes again
        return Precopy(ok=False, stages=self.spec.migration_max_stages, precopy_s=t, stall_s=0.0, blocks=copied,
                       reason=f"did not converge in {self.spec.migration_max_stages} stages")

    def layer_restore_s(self, nbytes: int, source: Literal["host", "peer"] = "host") -> float:
        """Copying dropped layers back onto a device."""
        return (self.host if source == "host" else self.kv).transfer_s(nbytes)

    def load_s(self, nbytes: int, *, in_host_memory: bool) -> float:
        """An adapter's or a model's weights onto a device: from host memory, or first from disk."""
        if in_host_memory:
            return self.host.transfer_s(nbytes)
        if self.disk is None:
            raise ValueError("movement: this profile models no disk link (movement.disk_link is empty)")
        return self.host.transfer_s(nbytes) + self.disk.transfer_s(nbytes)


def movement_costs(spec: MovementSpec, links: dict[str, Link]) -> MovementCosts:
    """Resolve the spec's link names; a clear error names a missing one."""
    missing = [n for n in (spec.kv_link, spec.host_link, spec.disk_link) if n and n not in links]
    if missing:
        raise ValueError(f"movement: link(s) {', '.join(missing)} not in the profile's links ({', '.join(links)})")
    disk = links[spec.disk_link] if spec.disk_link else None
    return MovementCosts(spec, links[spec.kv_link], links[spec.host_link], disk)


class PrefillCost(msgspec.Struct, frozen=True, kw_only=True):
    """The part of a profile's `[step]` a token-mode migration costs: the destination re-prefills the
    context (other step coefficients are the simulator's; unknown fields are ignored here)."""

    overhead_s: float
    prefill_per_token_s: float

    def reprefill_s(self, tokens: int) -> float:
        return self.overhead_s + self.prefill_per_token_s * max(0, tokens)


class MovementProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What the planner reads of a simulator cost profile (loadgen/sim/profiles/*.toml): its links, which
    link moves what, and the prefill cost; the rest of the file is the simulator's and is ignored."""

    name: str = ""
    links: list[LinkSpec]
    movement: MovementSpec = MovementSpec()
    step: PrefillCost

    def costs(self) -> MovementCosts:
        return movement_costs(self.movement, {link.name: link for link in self.links})


def decode_movement_profile(data: bytes | str, *, origin: str = "<profile>", fmt: str = "toml") -> MovementProfile:
    """The planner's view of a cost profile from TOML (or JSON) text; a ValueError naming `origin` when a
    needed part is missing or wrong (no `[[links]]`, no `[step]`, a link the `[movement]` names is absent)."""
    if fmt not in ("toml", "json"):
        raise ValueError(f"cost profile {origin}: format must be 'toml' or 'json', got {fmt!r}")
    try:
        decode = msgspec.json.decode if fmt == "json" else msgspec.toml.decode
        profile = decode(data, type=MovementProfile)
        if not profile.links:
            raise ValueError("it names no [[links]]")
        for link in profile.links:
            if link.bandwidth_bytes_per_s <= 0 or link.latency_s < 0:
                raise ValueError(f"link {link.name!r} needs bandwidth_bytes_per_s > 0 and latency_s >= 0")
        profile.costs()
    except (msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"cost profile {origin}: {exc}") from None
    return profile


__all__ = [
    "Link", "LinkSpec", "MovementCosts", "MovementProfile", "MovementSpec", "Precopy", "PrefillCost",
    "decode_movement_profile", "movement_costs",
]
