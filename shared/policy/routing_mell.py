"""`mell` routing: send a new request where MELL would allocate it, from the planner's placement hints.

The planner publishes, per model and interval, the worker MELL's Allocate would choose for each KV
size class (`PlacementHints`, shared/planner/mell_hints.py). A request's class is its prompt's KV
bytes (prompt tokens x the instance's KV bytes per token), the KV it holds when MELL first sees it.
The hinted worker's instance gets it when the hint is fresh, the instance is live and has room, and
the request fits what MELL's plan leaves free there (`room_bytes`); otherwise, and when there is no
hint, the fallback policy (least load) chooses and the reason is counted. The dispatcher and the
simulator (loadgen/sim/kv_packing_core.py) route through this same code.

Pure: no I/O, no clock reads (`now` is an argument). The latest hints per model are state the
caller feeds in (`take_hints`), like the instance views. `valid_until` is the planner's clock read
against the dispatcher's: clocks skewed by more than the validity (3 planning intervals) make every
hint stale, which only means routing by load.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from shared.events.plan import PlacementEntry, PlacementHints
from shared.policy.admission import has_room
from shared.policy.routing import InstanceView, LeastOutstandingWork, RequestView, RoutingPolicy, candidates

# outcomes counted by MellRouting.counts: "hinted", or why the fallback chose
OUTCOMES = ("hinted", "no_hint", "stale", "no_kv_size", "unplaced", "unavailable", "no_room")


def prompt_kv_bytes(request: RequestView, instances: Sequence[InstanceView]) -> int | None:
    """The KV bytes of the request's prompt on its model's instances (None: no instance reports its
    KV bytes per token)."""
    per_token = max((inst.kv_bytes_per_token for inst in instances if inst.model == request.model), default=0.0)
    return None if per_token <= 0 else int(request.prompt_tokens * per_token)


def entry_for(hints: PlacementHints, kv_bytes: int) -> PlacementEntry | None:
    """The class entry whose (lower, upper] holds `kv_bytes`; a prompt beyond MELL's capacity is L
    (MELL clips it to one device)."""
    entries = sorted(hints.entries, key=lambda e: e.upper_bytes)
    for entry in entries:
        if entry.lower_bytes < kv_bytes <= entry.upper_bytes:
            return entry
    if entries and kv_bytes > entries[-1].upper_bytes:
        return entries[-1]
    if entries and kv_bytes <= entries[0].lower_bytes:  # an empty prompt: the smallest class
        return entries[0]
    return None


def hinted_choice(request: RequestView, instances: Sequence[InstanceView], hints: PlacementHints | None,
                  now: float) -> tuple[str | None, str]:
    """(instance id, "hinted"), or (None, why the hint does not apply: one of OUTCOMES)."""
    if hints is None or hints.model != request.model:
        return None, "no_hint"
    if now > hints.valid_until:
        return None, "stale"
    kv_bytes = prompt_kv_bytes(request, instances)
    if kv_bytes is None:
        return None, "no_kv_size"
    entry = entry_for(hints, kv_bytes)
    if entry is None or entry.worker_id is None:
        return None, "unplaced"  # MELL would open a device it has no id for: least load finds an idle one
    able = candidates(request, instances)
    target = next((inst for inst in able if inst.worker_id == entry.worker_id), None)
    if target is None:  # not live, or not offered (the dispatcher's admission found it full)
        return None, "unavailable"
    if kv_bytes > entry.room_bytes or not has_room(request, target):
        return None, "no_room"
    return target.instance_id, "hinted"


class MellRouting:
    """RoutingPolicy `mell`: the planner's hint when it applies, else `fallback` (least load)."""

    name = "mell"

    def __init__(self, fallback: RoutingPolicy | None = None) -> None:
        self.fallback = fallback if fallback is not None else LeastOutstandingWork()
        self.hints: dict[str, PlacementHints] = {}  # model -> the latest hints
        self.counts: Counter[str] = Counter()  # OUTCOMES

    def take_hints(self, hints: PlacementHints) -> bool:
        """Keep `hints` if they are the newest for their model; False when older ones arrive late."""
        known = self.hints.get(hints.model)
        if known is not None and known.ts > hints.ts:
            return False
        self.hints[hints.model] = hints
        return True

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        chosen, outcome = hinted_choice(request, instances, self.hints.get(request.model), now)
        self.counts[outcome] += 1
        return chosen if chosen is not None else self.fallback.choose(request, instances, now)


__all__ = ["MellRouting", "OUTCOMES", "entry_for", "hinted_choice", "prompt_kv_bytes"]
