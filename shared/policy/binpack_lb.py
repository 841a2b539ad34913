"""LB, the load-balancing baseline of MELL's evaluation (§VIII-B: "dispatches incoming requests to
the GPU with the least memory (i.e., worst fit) and achieves load-balancing via request migration by
transferring the KV cache between GPUs, adopted by Llumnix"), as a pure KV-packing policy.

As Llumnix does it (Sun et al., OSDI'24 §4.4; its global scheduler's defaults: load filter, Balanced
pairing, shortest-job-first request choice, one migration per instance at a time):
- dispatch: worst fit by what each device's requests hold now (running, and waiting for memory: a
  waiting request's demand counts, Llumnix's virtual usage) plus what a copy still holds there; a
  device is activated when no active device fits the arrival (§VIII-B), terminated when idle;
- no move on overflow: when a device's requests outgrow it, its engine preempts the newest, which
  wait there (binpack_base.py); balancing then moves load off it;
- periodic load balancing (`balance`, once per planning interval; Llumnix polls every 50 ms): a
  device's freeness is its free memory per request it holds. Sources: devices holding more than C
  (requests waiting: Llumnix's "killed requests") or with less than `migrate_out_free` bytes free per
  request (Llumnix's migrate-out threshold, 3 decode steps of KV); destinations: the others whose
  freeness stays above that after taking the request. Sources from the least free, destinations
  from the most free are paired in order; each pair migrates one running request, the shortest
  (cheapest to move) that fits and keeps the source at least as loaded as the destination (the
  move narrows the pair's difference, never reverses it). A device with a migration in flight
  (`busy`) takes no part: one migration per device at a time. The move is a live KV migration;
  the simulator charges it (pre-copy over the kv link, the source held until the hand-over, a stall)
  and, when it fails, puts the request back (`relocate`).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from shared.policy.binpack_base import BinPackPolicy
from shared.policy.mell_ops import Move


def worst_fit(policy: BinPackPolicy, charge: int, exclude: str | None) -> str | None:
    """The active device with the most free memory that fits `charge` (first activated wins ties)."""
    best, best_free = None, charge - 1
    for d in policy._order:
        free = policy._free(d)
        if free > best_free and d != exclude:
            best, best_free = d, free
    return best


class LoadBalance(BinPackPolicy):
    name = "LB"
    migrates = True

    def __init__(self, capacity: int, devices: Sequence[str] | None = None, *, migrate_out_free: int = 0) -> None:
        super().__init__(capacity, devices)
        if migrate_out_free < 0:
            raise ValueError(f"migrate_out_free must be >= 0, got {migrate_out_free}")
        self.migrate_out_free = migrate_out_free  # bytes free per request below which a device sheds load

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return worst_fit(self, charge, exclude)

    def load(self, device: str) -> int:
        """What the device holds: its requests' charges (running and waiting) and a copy still leaving it."""
        return self._load[device] + self.held.get(device, 0)

    def freeness(self, device: str, extra_bytes: int = 0, extra_requests: int = 0) -> float:
        """Free bytes per request held (Llumnix's freeness, in bytes rather than decode steps)."""
        n = len(self._members[device]) + extra_requests
        return (self.capacity - self.load(device) - extra_bytes) / max(1, n)

    def balance(self, busy: Collection[str] = (), movable: Callable[[str], bool] | None = None) -> list[Move]:
        """One balancing round (see the module docstring); the moves are booked at once. `busy`: devices with
        a migration in flight; `movable(request)`: whether it can migrate now (running, not already moving)."""
        rank = {d: i for i, d in enumerate(self._order)}
        ready = [d for d in self._order if d not in busy]
        thr = self.migrate_out_free
        sources = sorted((d for d in ready if self.load(d) > self.capacity or self.freeness(d) < thr),
                         key=lambda d: (self.freeness(d), rank[d]))
        chosen = set(sources)
        dests = sorted((d for d in ready if d not in chosen and self.load(d) <= self.capacity),
                       key=lambda d: (-self.freeness(d), rank[d]))
        moves: list[Move] = []
        for src, dst in zip(sources, dests):
            room = self._free(dst)
            best, best_key = None, None
            for rid, s in self._members[src].items():
                if s > room or (movable is not None and not movable(rid)):
                    continue
                if self.freeness(dst, s, 1) < thr:  # the destination must stay out of the sources
                    continue
                if self.freeness(src, -s, -1) > self.freeness(dst, s, 1):  # would reverse the pair
                    continue
                key = (s, self._seq[rid])
                if best_key is None or key < best_key:
                    best, best_key = rid, key
            if best is not None:
                size, charge = self._size[best], self._members[src][best]
                self._remove(best, src)
                self._add(best, size, dst, charge)
                moves.append(Move(request_id=best, source=src, destination=dst))
        return moves


class LoadBalanceOpen(LoadBalance):
    """LB with Eq. 2 kept (an extra arm at equal service): after the balancing round, a device whose requests
    still outgrow it (no pair relieved it) moves requests off -- the smallest that ends the overflow, else the
    largest, again while it overflows -- to the freest device with room, or to a GPU it opens (as Llumnix's
    auto-scaling would), instead of letting its engine preempt them."""

    name = "LB-open"

    def balance(self, busy: Collection[str] = (), movable: Callable[[str], bool] | None = None) -> list[Move]:
        moves = super().balance(busy, movable)
        moved = {m.request_id for m in moves}
        for src in [d for d in self._order if d not in busy and self._load[d] > self.capacity]:
            while src in self._members and self._load[src] > self.capacity:
                over = self._load[src] - self.capacity
                cands = [(c, rid) for rid, c in self._members[src].items()
                         if rid not in moved and (movable is None or movable(rid))]
                if not cands:
                    break
                enough = [x for x in cands if x[0] >= over]
                charge, rid = min(enough) if enough else max(cands)
                dst = worst_fit(self, charge, src) or self._spare()
                if dst is None:
                    break
                size = self._size[rid]
                self._remove(rid, src)
                self._add(rid, size, dst, charge)
                moved.add(rid)
                moves.append(Move(request_id=rid, source=src, destination=dst))
        return moves
