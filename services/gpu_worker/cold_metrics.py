"""What the engine's cold-start rule chose, as a Prometheus gauge (issue 31, docs/caraserve.md).

`tidal_worker_lora_cold_starts{worker, instance, choice}`: cold LoRA requests of the instance's
engine by the choice its rule made (`cpu_assist` | `async` | `inline`; a request counted once, at
its first decision), since the engine started — cumulative, read from `cold.costs.counts` at each
stats interval. Instances that went away lose their series.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Gauge

from shared.metrics import REGISTRY

COLD_STARTS = Gauge(
    "tidal_worker_lora_cold_starts",
    "Cold LoRA requests by the engine's cold-start choice (CPU assist, async load, inline load), since it started",
    ["worker", "instance", "choice"], registry=REGISTRY,
)

_exported: dict[str, set[tuple[str, str, str]]] = {}  # worker -> label sets set last time


def export_cold_choices(worker_id: str, counts: Iterable[tuple[str, Mapping[str, int]]]) -> None:
    """`counts`: (instance id, its engine's counts per choice)."""
    current = set()
    for instance, per in counts:
        for choice, n in dict(per).items():  # a copy: the engine thread may be counting
            labels = (worker_id, instance, choice)
            COLD_STARTS.labels(*labels).set(n)
            current.add(labels)
    for labels in _exported.get(worker_id, set()) - current:
        try:
            COLD_STARTS.remove(*labels)
        except KeyError:
            pass
    _exported[worker_id] = current


__all__ = ["COLD_STARTS", "export_cold_choices"]
