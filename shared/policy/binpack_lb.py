"""LB, the load-balancing baseline of MELL's evaluation (§VIII-B: worst fit plus Llumnix's
KV-migration load balancing), as a pure KV-packing policy.

LB can migrate, so it admits a request at its current KV size (no reservation for growth):
when requests outgrow a device it migrates them away instead. Dispatch is worst fit (the
device with the most free memory, Llumnix's dispatch to the freest instance). Migrations, all
of KV (`migrates` is True):

- balancing: each batch ends with one round that pairs the fullest device with the emptiest,
  the second fullest with the second emptiest, ... and moves one request per pair when that
  narrows the gap (Llumnix's repeated high/low migration pairs);
- de-fragmentation: a request that fits nowhere first tries to make room on the emptiest
  device by migrating its smallest requests to other devices (Llumnix's virtual usage of a
  queued request, which makes its instance shed load);
- overload: a device whose requests outgrew it migrates requests out (the smallest one that
  clears the excess, else the largest) instead of preempting them.

A device is activated when no device fits an arrival even after de-fragmentation, and
terminated when it is idle (§VIII-B); LB never drains a device on purpose.
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.binpack_base import BinPackPolicy
from shared.policy.mell_ops import Move


def worst_fit(policy: BinPackPolicy, charge: int, exclude: str | None) -> str | None:
    """The active device with the most free memory that fits `charge` (first activated wins ties)."""
    best, best_free = None, charge - 1
    for d in policy._order:
        free = policy.capacity - policy._load[d]
        if free > best_free and d != exclude:
            best, best_free = d, free
    return best


class LoadBalance(BinPackPolicy):
    name = "LB"
    migrates = True

    def __init__(self, capacity: int, devices: Sequence[str] | None = None, *, balance_gap: float = 0.1) -> None:
        super().__init__(capacity, devices)
        self.balance_gap = balance_gap * capacity  # pairs closer than this are balanced already

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        return worst_fit(self, charge, exclude)

    def _relieve(self, device: str, moves: list[Move]) -> None:
        """Migrate out of an overloaded device: the smallest request that clears the excess, else the largest."""
        while self._load[device] > self.capacity:
            excess = self._load[device] - self.capacity
            members = self._members[device]
            clearing = [r for r, s in members.items() if s >= excess]
            rid = (min(clearing, key=lambda r: (members[r], self._seq[r])) if clearing
                   else max(members, key=lambda r: (members[r], -self._seq[r])))
            size = members[rid]
            self._remove(rid, device)
            target = self._choose(size, exclude=device) or self._activate()
            self._add(rid, size, target)
            moves.append(Move(request_id=rid, source=device, destination=target))

    def _make_room(self, charge: int, moves: list[Move]) -> str | None:
        """Free `charge` on the emptiest device by migrating its smallest requests to other devices."""
        if len(self._order) < 2:
            return None
        target = max(self._order, key=lambda d: (self._free(d), -self._order.index(d)))
        need = charge - self._free(target)
        load = dict(self._load)
        plan: list[tuple[str, str, int]] = []
        for rid, s in sorted(self._members[target].items(), key=lambda kv: (kv[1], self._seq[kv[0]])):
            if need <= 0:
                break
            dest = max((d for d in self._order if d != target and load[d] + s <= self.capacity),
                       key=lambda d: self.capacity - load[d], default=None)
            if dest is None:
                return None
            load[dest] += s
            need -= s
            plan.append((rid, dest, s))
        if need > 0:
            return None
        for rid, dest, s in plan:
            self._remove(rid, target)
            self._add(rid, s, dest)
            moves.append(Move(request_id=rid, source=target, destination=dest))
        return target

    def _end_of_batch(self) -> list[Move]:
        """One balancing round: fullest with emptiest, second fullest with second emptiest, ..."""
        ranked = sorted(self._order, key=lambda d: self._load[d])
        moves: list[Move] = []
        for i in range(len(ranked) // 2):
            low, high = ranked[i], ranked[-1 - i]
            gap = self._load[high] - self._load[low]
            if gap <= self.balance_gap:
                break
            room = self._free(low)
            best, best_score = None, gap  # the move must narrow the gap: |gap - 2s| < gap
            for rid, s in self._members[high].items():
                score = abs(gap - 2 * s)
                if s <= room and score < best_score:
                    best, best_score = rid, score
            if best is None:
                continue
            size = self._members[high][best]
            self._remove(best, high)
            self._add(best, size, low)
            moves.append(Move(request_id=best, source=high, destination=low))
        return moves
