"""What the engine's cold-start rule chose (issue 31, docs/caraserve.md): a Prometheus gauge, and
`InstanceStats.lora_cold` in the worker's stats (`cold_starts`: counts, mid-step takeovers, the latest
decisions with their reasons — what `tidal status` shows).

`tidal_worker_lora_cold_starts{worker, instance, choice}`: cold LoRA requests of the instance's
engine by the choice its rule made (`cpu_assist` | `async` | `inline`; a request counted once, at
its first decision), since the engine started — cumulative, read from `cold.costs.counts` at each
stats interval. Instances that went away lose their series.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from prometheus_client import Gauge

from shared.events.base import ID_PATTERN
from shared.events.worker import MAX_COLD_DECISIONS, LoRAColdDecision, LoRAColdStarts
from shared.metrics import REGISTRY

COLD_STARTS = Gauge(
    "tidal_worker_lora_cold_starts",
    "Cold LoRA requests by the engine's cold-start choice (CPU assist, async load, inline load), since it started",
    ["worker", "instance", "choice"], registry=REGISTRY,
)

_ID = re.compile(ID_PATTERN)
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


def cold_starts(engine: object) -> LoRAColdStarts | None:
    """The engine's cold-start decisions for its InstanceStats (None: it never had a cold LoRA request).
    Read from the stats side while the engine thread may be deciding: copies, taken at once."""
    cold = getattr(engine, "cold", None)
    costs = getattr(cold, "costs", None)
    if costs is None:
        return None
    counts = dict(costs.counts)
    if not any(counts.values()):
        return None
    try:
        latest = list(costs.trace.items())[-MAX_COLD_DECISIONS:]
    except RuntimeError:  # changed while copied: the next interval has them
        latest = []
    return LoRAColdStarts(cpu_assist=counts.get("cpu_assist", 0), async_load=counts.get("async", 0),
                          inline=counts.get("inline", 0), mid_step_takeovers=getattr(cold, "mid_step_takeovers", 0),
                          recent=[LoRAColdDecision(request_id=rid[:128], choice=c.kind, reason=c.reason[:240])
                                  for rid, c in latest if _ID.fullmatch(rid) and len(rid) <= 64])


__all__ = ["COLD_STARTS", "cold_starts", "export_cold_choices"]
