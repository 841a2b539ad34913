"""Which KV prefixes each instance holds, as the dispatcher knows it (pure; time passed in).

Two sources, merged per instance:

* the instance's latest `PrefixSummary` (`tidal.v1.evt.worker.prefixes`): the block hashes its
  prefix cache holds, most recent first, bounded. A summary older than `max_age_s` (by when it
  came here, so a worker's clock does not matter) is dropped: a worker that went silent or lost
  its cache stops attracting requests. An older summary (by the worker's `ts`, then `seq`) never
  replaces a newer one.
* predictions: when this dispatcher routes a request to an instance, the request's block hashes
  will be there once it is prefilled, long before the next summary says so (Dynamo's router
  does the same with its own routing decisions). They are kept for `predict_s` at most, so a
  request that was refused or whose blocks were evicted soon stops counting.

`match(instance, hashes, now)`: how many leading blocks of a request the instance holds.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.events import PrefixSummary

MAX_PREDICTED = 4096  # predicted block hashes kept per instance (the oldest go first)


@dataclass(frozen=True, slots=True)
class HeldPrefixes:
    """One instance's latest summary, as received."""

    worker_id: str
    model: str
    block_size: int
    hashes: frozenset[int]
    ts: float  # the worker's clock
    seq: int
    received: float  # this dispatcher's clock
    hit_blocks: int
    queried_blocks: int


class PrefixIndex:
    def __init__(self, *, max_age_s: float = 10.0, predict_s: float = 5.0) -> None:
        self.max_age_s = max_age_s
        self.predict_s = predict_s
        self.held: dict[str, HeldPrefixes] = {}
        self.predicted: dict[str, OrderedDict[int, float]] = {}  # instance -> hash -> until

    # --- inputs ---------------------------------------------------------------------------
    def take(self, msg: PrefixSummary, now: float) -> bool:
        """Keep `msg` unless the summary held for its instance is newer; True when kept."""
        old = self.held.get(msg.instance_id)
        if old is not None and old.worker_id == msg.worker_id and (msg.ts, msg.seq) <= (old.ts, old.seq):
            return False
        self.held[msg.instance_id] = HeldPrefixes(
            worker_id=msg.worker_id, model=msg.model, block_size=msg.block_size, hashes=frozenset(msg.hashes),
            ts=msg.ts, seq=msg.seq, received=now, hit_blocks=msg.hit_blocks, queried_blocks=msg.queried_blocks)
        return True

    def predict(self, instance_id: str, hashes: list[int], now: float) -> None:
        """`hashes` will be held by `instance_id` once the request routed there is prefilled."""
        if not hashes:
            return
        table = self.predicted.setdefault(instance_id, OrderedDict())
        until = now + self.predict_s
        for h in hashes:
            table[h] = until
            table.move_to_end(h)
        while len(table) > MAX_PREDICTED:
            table.popitem(last=False)

    def expire(self, now: float) -> None:
        """Forget stale summaries and lapsed predictions."""
        for iid in [i for i, held in self.held.items() if now - held.received > self.max_age_s]:
            del self.held[iid]
        for iid, table in list(self.predicted.items()):
            while table and next(iter(table.values())) <= now:
                table.popitem(last=False)
            if not table:
                del self.predicted[iid]

    # --- reading --------------------------------------------------------------------------
    def fresh(self, instance_id: str, now: float) -> HeldPrefixes | None:
        held = self.held.get(instance_id)
        return held if held is not None and now - held.received <= self.max_age_s else None

    def block_size(self, instance_id: str, now: float) -> int | None:
        """The block size the instance's summary names (None: no fresh summary)."""
        held = self.fresh(instance_id, now)
        return None if held is None else held.block_size

    def match(self, instance_id: str, hashes: list[int], now: float) -> int:
        """Leading blocks of `hashes` the instance holds (its fresh summary or our live predictions)."""
        held = self.fresh(instance_id, now)
        predicted = self.predicted.get(instance_id)
        if held is None and not predicted:
            return 0
        n = 0
        for h in hashes:
            if held is not None and h in held.hashes:
                n += 1
                continue
            until = predicted.get(h) if predicted else None
            if until is None or until <= now:
                break
            n += 1
        return n


__all__ = ["HeldPrefixes", "MAX_PREDICTED", "PrefixIndex"]
