"""Lay a measured profile's device numbers over a cited profile (loadgen/sim/measured_overlay.py
says which and why). Pure; typed loosely so that profile.py can call it without an import circle:
both arguments are `CostProfile`s."""
from __future__ import annotations

from typing import Any

import msgspec

from loadgen.sim.profile_sources import FieldSource, cited
from shared.policy.movement import LinkSpec


def _host(m: Any) -> LinkSpec:
    return m.link(m.movement.host_link)


def _src(m: Any, key: str) -> FieldSource:
    return m.sources.get(key) or cited(f"{m.name}: {key}")


def overlay_cost(base: Any, m: Any) -> Any:
    """`base` with the device's numbers from `m`, and its sources saying which are which."""
    if base.device is not None:
        return base  # a measured profile itself: nothing to lay over it
    host = base.movement.host_link
    links = [LinkSpec(name=l.name, latency_s=_host(m).latency_s, bandwidth_bytes_per_s=_host(m).bandwidth_bytes_per_s)
             if l.name == host else l for l in base.links]
    step = m.step
    models = {name: m.models.get(name, m.step) for name in base.models}
    worker = msgspec.structs.replace(base.worker, adapter_load_s=m.worker.adapter_load_s)
    sources = {f: cited(f"{base.name} (the paper's setting, loadgen/sim/profiles/)") for f in
               ("worker", "request_overhead_s", *(f"links.{l.name}" for l in base.links if l.name != host))}
    sources["step"] = _src(m, "step.overhead_s")
    for name in models:
        sources[f"models.{name}"] = _src(m, f"models.{name}.overhead_s" if name in m.models else "step.overhead_s")
    sources[f"links.{host}"] = _src(m, f"links.{m.movement.host_link}.bandwidth_bytes_per_s")
    sources["worker.adapter_load_s"] = _src(m, "worker.adapter_load_s")
    return msgspec.structs.replace(base, name=f"{base.name}+{m.name}", step=step, models=models, worker=worker,
                                   links=links, sources=sources, device=m.device,
                                   description=f"{base.description}; device numbers measured ({m.name})")


def overlay_fleet(base, m: Any):  # type: ignore[no-untyped-def]
    """A FleetProfile with the measured host link and engine start (the rest cited)."""
    assert m.device is not None
    host = base.movement.host_link
    links = [LinkSpec(name=l.name, latency_s=_host(m).latency_s, bandwidth_bytes_per_s=_host(m).bandwidth_bytes_per_s)
             if l.name == host else l for l in base.links]
    startup = msgspec.structs.replace(base.startup, engine_init_s=m.device.engine_start_s)
    return msgspec.structs.replace(base, name=f"{base.name}+{m.name}", links=links, startup=startup)


__all__ = ["overlay_cost", "overlay_fleet"]
